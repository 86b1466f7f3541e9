"""netcl benchmarks: pytest-benchmark tests, and a side-by-side table.

    python bench_netcl.py              # table: netcl (each backend) beside NumPy and PyTorch
    python bench_netcl.py --full       # also the large workloads on CPU devices (slow there)
    python bench_netcl.py --json PATH  # save the table's figures as JSON
    python bench_netcl.py --kernels conv [--amp]  # one step on the OpenCL device, kernel by kernel
    python -m pytest bench_netcl.py    # the same workloads as pytest-benchmark tests

Figures are ratios measured in one run: these machines are shared and noisy, so only a side
by side comparison means anything. Every timed call ends with a sync (device.finish() or
torch.cuda.synchronize()), so queued work is counted.
"""
import argparse
import contextlib
import gc
import io
import json
import math
import platform
import statistics
import sys
import time

import numpy as np
import pytest

import netcl

try:
    import torch
except ImportError:
    torch = None


# ---------------------------------------------------------------------------- backends

def netcl_devices():
    """[(label, Device)] for the NumPy backend and, if present, the best OpenCL device."""
    devices = [("netcl-cpu", netcl.manager.default("cpu"))]
    try:
        devices.append(("netcl-opencl", netcl.manager.default("opencl")))
    except RuntimeError:
        pass
    return devices


def is_gpu(device):
    return device.backend == "opencl" and "GPU" in netcl.cl.device_type.to_string(
        device.cl_device.type)


def timeit(fn, sync, min_seconds=0.5, min_calls=3, warmup=2):
    """Median seconds per call of fn(); sync() after each call makes queued work count."""
    for _ in range(warmup):
        fn()
    sync()
    times, started = [], time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - started < min_seconds:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return statistics.median(times)


# ---------------------------------------------------------------------------- workloads

def sgemm_netcl(device, n):
    """(fn, sync) computing an n x n x n float32 product on `device`."""
    rng = np.random.default_rng(0)
    a = netcl.Tensor.from_host(rng.standard_normal((n, n), np.float32), device.queue)
    b = netcl.Tensor.from_host(rng.standard_normal((n, n), np.float32), device.queue)
    return (lambda: netcl._gemm(a, b)), device.finish


def sgemm_numpy(n):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    return (lambda: a @ b), (lambda: None)


def sgemm_torch(n, where):
    a = torch.randn(n, n, device=where)
    b = torch.randn(n, n, device=where)
    return (lambda: a @ b), _torch_sync(where)


def hgemm_netcl(device, n):
    """(fn, sync): an n x n x n product of float16 operands accumulated in float32 (written as
    float16), as autocast runs it: on tensor cores where the device has them."""
    rng = np.random.default_rng(0)
    a, b = (netcl.Tensor.from_host(rng.standard_normal((n, n)).astype(np.float16), device.queue)
            for _ in range(2))
    return (lambda: netcl._gemm(a, b, half=True)), device.finish


def hgemm_torch(n):
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.float16) for _ in range(2))
    return (lambda: a @ b), torch.cuda.synchronize


def _torch_sync(where):
    return torch.cuda.synchronize if where == "cuda" else (lambda: None)


_last_model = [None]  # the model the latest mlp_step_* built, for the optimizer-only rows


def mlp_sizes(name):
    return {"small": ((784, 256, 256, 10), 128), "large": ((784, 4096, 4096, 10), 4096)}[name]


def _make_optimizer(params):
    """AdamW with fused clipping where it exists; SGD with momentum otherwise."""
    if hasattr(netcl.optim, "AdamW"):
        opt = netcl.optim.AdamW(params, lr=1e-3)
        return opt, (lambda: opt.step(max_norm=1.0))
    opt = netcl.optim.SGD(params, lr=0.01, momentum=0.9)
    return opt, opt.step


def mlp_step_netcl(device, sizes, batch, amp=False):
    """(fn, sync) for one training step of an MLP with ReLUs, cross-entropy, and the optimizer;
    amp=True: the forward under autocast, AdamW stepped through an AMPGradScaler (clip 1.0)."""
    netcl.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        layers += [netcl.nn.Linear(fan_in, fan_out, queue=device.queue), netcl.nn.ReLU()]
    model = netcl.nn.Sequential(*layers[:-1])
    _last_model[0] = model
    opt, step = _make_optimizer(model.parameters())
    rng = np.random.default_rng(0)
    x = netcl.Tensor.from_host(rng.standard_normal((batch, sizes[0]), np.float32), device.queue)
    y = netcl.Tensor.from_host(rng.integers(0, sizes[-1], batch).astype(np.int32), device.queue)
    y_host = y.to_host()
    scaler = netcl.AMPGradScaler(enabled=amp)

    def fn():
        with netcl.Tape() as tape, netcl.autocast(enabled=amp):
            loss = netcl.functional.cross_entropy(model(x), y_host)
        opt.zero_grad()
        if amp:
            tape.backward(scaler.scale(loss))
            scaler.step(opt, max_norm=1.0)
            scaler.update()
        else:
            tape.backward(loss)
            step()
    return fn, device.finish


def mlp_amp_comparison(device, sizes, batch):
    """{amp: (seconds per step, peak pool bytes)} for the float32 and the autocast step,
    measured one after the other. The peak counts what the step's model, optimizer, scaler and
    activations hold at most, above what was in use before it was built."""
    pool, results = device.pool, {}
    overall_peak = pool.peak_bytes
    for amp in (False, True):
        _last_model[0] = None  # freed now, not while this run is measured:
        gc.collect()  # a model freed by the collector during the run would lower its peak
        pool.empty_cache()  # the previous run's buffers go back to the driver
        baseline = pool.peak_bytes = pool.in_use_bytes  # the pool's peak from here on
        fn, sync = mlp_step_netcl(device, sizes, batch, amp)
        seconds = timeit(fn, sync)
        results[amp] = (seconds, pool.stats()["peak_bytes"] - baseline)
        overall_peak = max(overall_peak, pool.peak_bytes)
        del fn
    pool.peak_bytes = overall_peak  # the "pool peak" row still means the whole run
    return results


def mlp_step_numpy(sizes, batch):
    """The same step hand-written in NumPy float32: forward, backward, clip to norm 1.0 and
    AdamW (torch/optim/adamw.py's formulas, lr 1e-3, weight decay 0.01)."""
    rng = np.random.default_rng(0)
    ws = [rng.uniform(-1, 1, (o, i)).astype(np.float32) / np.sqrt(i) for i, o in zip(sizes[:-1], sizes[1:])]
    bs = [np.zeros(o, np.float32) for o in sizes[1:]]
    params = ws + bs
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    x = rng.standard_normal((batch, sizes[0]), np.float32)
    y = rng.integers(0, sizes[-1], batch)
    step = [0]

    def fn():
        acts = [x]
        for i, (w, b) in enumerate(zip(ws, bs)):
            h = acts[-1] @ w.T + b
            acts.append(np.maximum(h, 0) if i < len(ws) - 1 else h)
        logits = acts[-1]
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(batch), y] -= 1
        g = p / batch
        grads_w, grads_b = [None] * len(ws), [None] * len(ws)
        for i in reversed(range(len(ws))):
            grads_w[i], grads_b[i] = g.T @ acts[i], g.sum(0)
            if i:
                g = (g @ ws[i]) * (acts[i] > 0)
        grads = grads_w + grads_b
        norm = np.sqrt(sum(float(np.dot(g_.ravel(), g_.ravel())) for g_ in grads))
        coef = min(1.0 / (norm + 1e-6), 1.0)
        step[0] += 1
        lr, beta1, beta2 = 1e-3, 0.9, 0.999
        bc1, bc2 = 1 - beta1 ** step[0], 1 - beta2 ** step[0]
        for p_, g_, m_, v_ in zip(params, grads, m, v):
            g_ *= coef
            p_ *= 1 - lr * 0.01
            m_ *= beta1
            m_ += (1 - beta1) * g_
            v_ *= beta2
            v_ += (1 - beta2) * g_ * g_
            p_ -= (lr / bc1) * m_ / (np.sqrt(v_) / np.sqrt(bc2) + 1e-8)
    return fn, (lambda: None)


def _torch_step(model, opt, where, amp):
    """PyTorch's AMP recipe as one step(loss_fn): the loss under autocast, the scaled
    backward, unscale, clip at 1.0, step, update (autocast and scaler off for float32)."""
    scaler = torch.amp.GradScaler(where, enabled=amp)

    def step(loss_fn):
        with torch.autocast(where, dtype=torch.float16, enabled=amp):
            loss = loss_fn()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    return step


def mlp_step_torch(sizes, batch, where, amp=False):
    """PyTorch's step; amp=True: autocast float16 and a GradScaler, as its AMP recipe."""
    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1]).to(where)
    _last_model[0] = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, sizes[0], device=where)
    y = torch.randint(0, sizes[-1], (batch,), device=where)
    step = _torch_step(model, opt, where, amp)
    return (lambda: step(lambda: torch.nn.functional.cross_entropy(model(x), y))), \
        _torch_sync(where)




def mlp_torch_amp_comparison(sizes, batch):
    """{amp: (seconds per step, peak CUDA bytes)} for PyTorch's float32 and autocast steps."""
    results = {}
    for amp in (False, True):
        _last_model[0] = None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        fn, sync = mlp_step_torch(sizes, batch, "cuda", amp)
        seconds = timeit(fn, sync)
        results[amp] = (seconds, torch.cuda.max_memory_allocated() - baseline)
        del fn
    return results


GPT = dict(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, batch_size=32)


def gpt_step_netcl(device, amp=False):
    """(fn, sync, tokens): one training step of examples/gpt_char.py's default model on random
    characters, AdamW with clipping at 1.0 (and autocast with a loss scaler if amp)."""
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples"))
    import gpt_char

    netcl.manual_seed(0)
    c = GPT
    model = gpt_char.GPT(c["vocab_size"], c["block_size"], c["n_layer"], c["n_head"],
                         c["n_embd"], queue=device.queue)
    _last_model[0] = model
    opt = netcl.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = netcl.AMPGradScaler(enabled=amp)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, c["vocab_size"], (c["batch_size"], c["block_size"])).astype(np.int32)
            for _ in range(2))

    def fn():
        with netcl.Tape() as tape, netcl.autocast(enabled=amp):
            loss = gpt_char.loss_of(model, x, y)
        opt.zero_grad()
        tape.backward(scaler.scale(loss))
        scaler.step(opt, max_norm=1.0)
        scaler.update()
    return fn, device.finish, c["batch_size"] * c["block_size"]


def gpt_step_torch(where, amp=False):
    """The same model and step in PyTorch eager (nanoGPT's modules), for tokens/s."""
    nnt, Ft = torch.nn, torch.nn.functional
    c = GPT

    class Block(nnt.Module):
        def __init__(self, n_embd, n_head):
            super().__init__()
            self.n_head = n_head
            self.ln_1, self.ln_2 = nnt.LayerNorm(n_embd), nnt.LayerNorm(n_embd)
            self.c_attn, self.c_proj = nnt.Linear(n_embd, 3 * n_embd), nnt.Linear(n_embd, n_embd)
            self.mlp = nnt.Sequential(nnt.Linear(n_embd, 4 * n_embd), nnt.GELU(approximate="tanh"),
                                      nnt.Linear(4 * n_embd, n_embd))

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            heads = lambda t: t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            y = Ft.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
            return x + self.mlp(self.ln_2(x))

    class GPTModel(nnt.Module):
        def __init__(self):
            super().__init__()
            self.wte = nnt.Embedding(c["vocab_size"], c["n_embd"])
            self.wpe = nnt.Embedding(c["block_size"], c["n_embd"])
            self.h = nnt.Sequential(*[Block(c["n_embd"], c["n_head"]) for _ in range(c["n_layer"])])
            self.ln_f = nnt.LayerNorm(c["n_embd"])
            self.lm_head = nnt.Linear(c["n_embd"], c["vocab_size"], bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            return self.lm_head(self.ln_f(self.h(x)))

    torch.manual_seed(0)
    model = GPTModel().to(where)
    _last_model[0] = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = (torch.randint(0, c["vocab_size"], (c["batch_size"], c["block_size"]), device=where)
            for _ in range(2))
    step = _torch_step(model, opt, where, amp)

    def loss_fn():
        logits = model(x)
        return Ft.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
    return (lambda: step(loss_fn)), _torch_sync(where), c["batch_size"] * c["block_size"]


CONV = dict(N=64, C=32, H=28, W=28, K=64, R=3, S=3, pad=1)
CONV_FLOPS = 3 * 2 * 64 * 28 * 28 * 64 * 32 * 3 * 3  # forward, dx and dw products (stride 1)


def _conv_arrays():
    rng = np.random.default_rng(0)
    c = CONV
    return (rng.standard_normal((c["N"], c["C"], c["H"], c["W"]), np.float32),
            (rng.standard_normal((c["K"], c["C"], c["R"], c["S"])) * 0.05).astype(np.float32),
            rng.standard_normal(c["K"]).astype(np.float32),
            rng.standard_normal((c["N"], c["K"], c["H"], c["W"]), np.float32))


def conv_netcl(device, amp=False):
    """(fn, sync): conv2d forward (under autocast if amp), then backward for input, weight
    and bias."""
    x, w, b, g = _conv_arrays()
    params = [netcl.Parameter(netcl.Tensor.from_host(a, device.queue)) for a in (x, w, b)]
    grad = netcl.Tensor.from_host(g, device.queue)

    def fn():
        for p in params:
            p.grad = None
        with netcl.Tape() as tape, netcl.autocast(enabled=amp):
            out = netcl.functional.conv2d(*params, padding=CONV["pad"])
        tape.backward(out, grad=grad)
    return fn, device.finish


def conv_numpy():
    """Plain NumPy im2col: forward by one product, dw and dx by products, col2im by slices."""
    from numpy.lib.stride_tricks import sliding_window_view
    x, w, b, g = _conv_arrays()
    N, C, H, W, K, R, S, P = (CONV[k] for k in ("N", "C", "H", "W", "K", "R", "S", "pad"))

    def fn():
        padded = np.pad(x, ((0, 0), (0, 0), (P, P), (P, P)))
        cols = sliding_window_view(padded, (R, S), axis=(2, 3)).transpose(0, 2, 3, 1, 4, 5)
        cols = cols.reshape(N * H * W, C * R * S)
        w_rows = w.reshape(K, C * R * S)
        np.ascontiguousarray((cols @ w_rows.T).reshape(N, H, W, K).transpose(0, 3, 1, 2)
                             + b.reshape(1, K, 1, 1))
        g_pixels = g.transpose(0, 2, 3, 1).reshape(N * H * W, K)
        g_pixels.T @ cols, g_pixels.sum(axis=0)
        dcols = (g_pixels @ w_rows).reshape(N, H, W, C, R, S)
        dpadded = np.zeros_like(padded)
        for r in range(R):
            for s_ in range(S):
                dpadded[:, :, r:r + H, s_:s_ + W] += dcols[..., r, s_].transpose(0, 3, 1, 2)
    return fn, (lambda: None)


def conv_torch(where, amp=False):
    """PyTorch's conv2d in true float32: cuDNN may use TF32 for convolutions by default
    (torch.backends.cudnn.allow_tf32), so that is turned off, and benchmark mode lets cuDNN
    pick its fastest float32 algorithm, as users run it. amp: under autocast float16."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    x, w, b, g = (torch.from_numpy(a).to(where) for a in _conv_arrays())
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()

    def fn():
        with torch.autocast(where, dtype=torch.float16, enabled=amp):
            out = torch.nn.functional.conv2d(x, w, b, padding=CONV["pad"])
        out.backward(g)
    return fn, _torch_sync(where)


LOADER_SAMPLES, LOADER_FEATURES, LOADER_BATCH = 60000, 784, 128
LOADER_CONFIGS = [  # (label, DataLoader keyword arguments, upload to the OpenCL device)
    ("num_workers=0", {}, False),
    ("num_workers=2", {"num_workers": 2}, False),
    ("num_workers=2, use_shared_mem", {"num_workers": 2, "use_shared_mem": True}, False),
    ("bind_queue, num_workers=0", {}, True),
    ("bind_queue, num_workers=2, use_shared_mem", {"num_workers": 2, "use_shared_mem": True}, True),
]


def loader_epoch(kwargs, on_device):
    """(fn, sync): one shuffled epoch over a 60000 x 784 float32 ArrayDataset, batch 128.
    Worker start-up is inside the epoch (that is what an epoch costs); the consumer does
    nothing with a batch, so this is the loader's ceiling."""
    rng = np.random.default_rng(0)
    dataset = netcl.ArrayDataset(rng.random((LOADER_SAMPLES, LOADER_FEATURES), dtype=np.float32),
                                 rng.integers(0, 10, LOADER_SAMPLES))
    loader = netcl.DataLoader(dataset, batch_size=LOADER_BATCH, seed=0, **kwargs)
    sync = lambda: None
    if on_device:
        device = netcl.manager.default("opencl")
        loader.bind_queue(device.queue)
        sync = device.finish

    def fn():
        for _ in loader:
            pass
    return fn, sync


def adamw_step_netcl(device):
    """(fn, sync): AdamW step(max_norm=1.0) alone, on the gradients of one backward."""
    fn, _ = mlp_step_netcl(device, *mlp_sizes("small"))
    fn()  # leaves gradients in place
    opt = netcl.optim.AdamW([p for p in _last_model[0].parameters()], lr=1e-3)
    fn()
    return (lambda: opt.step(max_norm=1.0)), device.finish


def adamw_step_torch(where):
    sizes, batch = mlp_sizes("small")
    fn, sync = mlp_step_torch(sizes, batch, where)
    fn()
    params = list(_last_model[0].parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return step, sync


def fit_epoch(device, dataset):
    """(fn, samples, steps): one Trainer.fit epoch, AdamW with grad_clip 1.0, metrics_stride 10.
    dataset "digits": scikit-learn's 1797 digits, MLP 64-128-10, batch 32; "synthetic":
    60000 x 784 float32, MLP 784-256-256-10, batch 128."""
    rng = np.random.default_rng(0)
    if dataset == "digits":
        from sklearn.datasets import load_digits
        digits = load_digits()
        x, y, sizes, batch = (digits.data / 16).astype(np.float32), digits.target, (64, 128, 10), 32
    else:
        x, y = rng.random((60000, 784), dtype=np.float32), rng.integers(0, 10, 60000)
        sizes, batch = (784, 256, 256, 10), 128
    netcl.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        layers += [netcl.nn.Linear(fan_in, fan_out, queue=device.queue), netcl.nn.ReLU()]
    model = netcl.nn.Sequential(*layers[:-1])
    trainer = netcl.Trainer(model, netcl.optim.AdamW(model.parameters(), lr=1e-3),
                            device_queue=device.queue, grad_clip=1.0, metrics_stride=10)
    loader = netcl.DataLoader(netcl.ArrayDataset(x, y), batch_size=batch, seed=0,
                              device_queue=device.queue)
    return (lambda: trainer.fit(loader, epochs=1)), len(x), len(loader)


def fit_figures(device, dataset):
    """(samples/s of a fit epoch, host syncs per 100 steps), after a warm-up epoch."""
    fn, samples, steps = fit_epoch(device, dataset)
    with contextlib.redirect_stdout(io.StringIO()):  # fit prints its epoch line
        fn()
        syncs = device.syncs
        started = time.perf_counter()
        fn()
        seconds = time.perf_counter() - started
    return samples / seconds, 100 * (device.syncs - syncs) / steps


def launch_overhead(device, calls=2000):
    """Microseconds per enqueued elementwise op on a tiny tensor, one sync at the end."""
    x = netcl.Tensor.from_host(np.ones(256, np.float32), device.queue)
    device.finish()
    started = time.perf_counter()
    for _ in range(calls):
        netcl._unary_tensor("relu", x)
    device.finish()
    return 1e6 * (time.perf_counter() - started) / calls


def syncs_per_step(device, sizes, batch, steps=10, amp=False):
    fn, sync = mlp_step_netcl(device, sizes, batch, amp)
    fn()
    sync()
    before_syncs, before_launches = device.syncs, device.launches
    for _ in range(steps):
        fn()
    return (device.syncs - before_syncs) / steps, (device.launches - before_launches) / steps


PROFILED = ("conv", "mlp-small", "mlp-large", "gpt")  # the workloads kernel_profile takes


def _profiled_step(workload, device, amp):
    """(fn, sync) for one step of a PROFILED workload on `device`."""
    if workload == "conv":
        return conv_netcl(device, amp)
    if workload == "gpt":
        return gpt_step_netcl(device, amp)[:2]
    return mlp_step_netcl(device, *mlp_sizes(workload.split("-")[1]), amp)


def kernel_profile(workload, device, amp=False, steps=50):
    """Where one training step of `workload` (PROFILED) goes on the OpenCL `device`, kernel
    by kernel: the step runs on a second queue of the device's context with profiling on,
    and each launch's OpenCL event gives its times (copies are not kernels: not counted).
    Returns a dict:
      kernels: [(name, launches per step, median µs each)], in the order of first launch
      (a name with "/h" is the float16-storage build);
      kernel_us: their sum per step; wall_us: the step's median by the host's clock on the
      device's own queue (no events), each step followed by a sync;
      timeline: for each launch of a step, medians over the steps (µs): (name, when the host
      called the launch and when it returned, from the step's start; when the device queued,
      submitted, started and ended the kernel, from the step's first kernel's queueing),
      or None where the steps did not all launch the same kernels.
    The gaps the timeline shows (a kernel started well after the one before it ended) are
    the device waiting for the host."""
    if workload not in PROFILED:
        raise ValueError(f"kernel_profile: workload must be one of {PROFILED}, got {workload!r}")
    if device.backend != "opencl":
        raise ValueError(f"kernel_profile: device must be an OpenCL device, got {device}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"kernel_profile: steps must be an int >= 1, got {steps!r}")
    cl = netcl.cl
    queue = cl.CommandQueue(device.queue.context, device.cl_device,
                            properties=cl.command_queue_properties.PROFILING_ENABLE)
    profiled = netcl.Tensor.empty((1,), queue=queue).device  # netcl's Device for that queue
    fn, sync = _profiled_step(workload, profiled, amp)
    records = []  # (name, event, host time the launch was called, host time it returned)
    launch = netcl.manager.Device.launch

    def recording_launch(self, name, *args, **kwargs):
        called = time.perf_counter()
        event = launch(self, name, *args, **kwargs)
        if self is profiled:
            records.append((name + ("/h" if kwargs.get("half") else ""), event, called,
                            time.perf_counter()))
        return event

    netcl.manager.Device.launch = recording_launch
    try:
        for _ in range(3):  # builds, pool buffers, and the autotune's first choices
            fn()
        sync()
        steps_seen = []
        for _ in range(steps):
            records.clear()
            started = time.perf_counter()
            fn()
            sync()
            steps_seen.append([(name, event, called - started, returned - started)
                               for name, event, called, returned in records])
    finally:
        netcl.manager.Device.launch = launch
    per_kernel = {}
    for step in steps_seen:
        for name, event, _, _ in step:
            per_kernel.setdefault(name, []).append(
                1e-3 * (event.profile.end - event.profile.start))
    kernels = [(name, len(times) / steps, statistics.median(times))
               for name, times in per_kernel.items()]
    timeline = None
    if steps_seen and all([r[0] for r in step] == [r[0] for r in steps_seen[0]]
                          for step in steps_seen):
        timeline = []
        for k, (name, *_) in enumerate(steps_seen[0]):
            rows = []
            for step in steps_seen:
                first = step[0][1].profile.queued
                _, event, called, returned = step[k]
                p = event.profile
                rows.append((1e6 * called, 1e6 * returned) + tuple(
                    1e-3 * (t - first) for t in (p.queued, p.submit, p.start, p.end)))
            timeline.append((name,) + tuple(statistics.median(column) for column in zip(*rows)))
    fn, sync = _profiled_step(workload, device, amp)  # the wall without events
    gc.collect()  # the profiled step's model and optimizer, then their buffers
    profiled.pool.empty_cache()
    return {"kernels": kernels, "kernel_us": sum(n * us for _, n, us in kernels),
            "wall_us": 1e6 * timeit(fn, sync), "timeline": timeline}


def print_kernel_profile(workload, device, amp=False):
    """kernel_profile as a table, then its timeline."""
    profile = kernel_profile(workload, device, amp)
    print(f"{workload} step{' under autocast' if amp else ''} on {device.name}: kernels by "
          f"OpenCL events (medians of 50 steps, µs)")
    for name, count, each in profile["kernels"]:
        print(f"  {name:40s} x{count:<5g} {each:10.1f}")
    print(f"  {'kernels, per step':47s} {profile['kernel_us']:10.1f}")
    print(f"  {'the step by the host clock (no events)':47s} {profile['wall_us']:10.1f}")
    if profile["timeline"]:
        print("timeline (µs; host: launch called, returned, from the step's start; device: "
              "queued, submitted, started, ended, from the first kernel's queueing)")
        for name, *times in profile["timeline"]:
            print(f"  {name:32s}" + "".join(f"{t:9.1f}" for t in times[:2]) + "  |"
                  + "".join(f"{t:9.1f}" for t in times[2:]))


# ---------------------------------------------------------------------------- pytest-benchmark

DEVICES = netcl_devices()


@pytest.fixture(params=[label for label, _ in DEVICES])
def device(request):
    return dict(DEVICES)[request.param]


def _bench(benchmark, fn, sync):
    fn()
    sync()
    benchmark(lambda: (fn(), sync()))


def _gpu_only(device):
    if not is_gpu(device):
        pytest.skip("a large workload: measured on GPUs only")


def test_sgemm_1024(benchmark, device):
    _bench(benchmark, *sgemm_netcl(device, 1024))


def test_sgemm_4096(benchmark, device):
    _gpu_only(device)
    _bench(benchmark, *sgemm_netcl(device, 4096))


def test_mlp_small_step(benchmark, device):
    _bench(benchmark, *mlp_step_netcl(device, *mlp_sizes("small")))


def test_mlp_large_step(benchmark, device):
    _gpu_only(device)
    _bench(benchmark, *mlp_step_netcl(device, *mlp_sizes("large")))


def test_adamw_step(benchmark, device):
    _bench(benchmark, *adamw_step_netcl(device))


def test_launch_overhead(benchmark, device):
    x = netcl.Tensor.from_host(np.ones(256, np.float32), device.queue)
    _bench(benchmark, lambda: netcl._unary_tensor("relu", x), device.finish)


def test_mlp_small_step_autocast(benchmark, device):
    _bench(benchmark, *mlp_step_netcl(device, *mlp_sizes("small"), amp=True))

def test_gpt_step(benchmark, device):
    fn, sync, _ = gpt_step_netcl(device)
    _bench(benchmark, fn, sync)


def test_conv2d_step(benchmark, device):
    _bench(benchmark, *conv_netcl(device))


@pytest.mark.parametrize("label, kwargs, on_device", LOADER_CONFIGS,
                         ids=[config[0] for config in LOADER_CONFIGS])
def test_loader_epoch(benchmark, label, kwargs, on_device):
    if on_device and not any(d.backend == "opencl" for _, d in DEVICES):
        pytest.skip("no OpenCL device")
    fn, sync = loader_epoch(kwargs, on_device)
    benchmark.pedantic(lambda: (fn(), sync()), rounds=2, iterations=1)


def test_fit_epoch_digits(benchmark, device):
    fn, _, _ = fit_epoch(device, "digits")
    with contextlib.redirect_stdout(io.StringIO()):
        fn()
        benchmark.pedantic(fn, rounds=2, iterations=1)


def test_sgemm_1024_numpy(benchmark):
    _bench(benchmark, *sgemm_numpy(1024))


def test_mlp_small_step_numpy(benchmark):
    _bench(benchmark, *mlp_step_numpy(*mlp_sizes("small")))


# ---------------------------------------------------------------------------- the table

def measure(full=False):
    """Rows of (workload, unit, {column: value}) for every backend present."""
    torch_places = (["cpu"] + (["cuda"] if torch.cuda.is_available() else [])) if torch else []
    rows = []
    any_gpu = any(is_gpu(d) for _, d in DEVICES)
    for n in (1024, 4096) if (full or any_gpu) else (1024,):
        flops = 2 * n ** 3
        cells = {}
        for label, device in DEVICES:
            if n <= 1024 or full or is_gpu(device):
                cells[label] = flops / timeit(*sgemm_netcl(device, n)) / 1e9
        cells["numpy"] = flops / timeit(*sgemm_numpy(n)) / 1e9
        for where in torch_places:
            if n <= 1024 or full or where == "cuda":
                cells[f"torch-{where}"] = flops / timeit(*sgemm_torch(n, where)) / 1e9
        rows.append((f"SGEMM n={n}", "GFLOP/s", cells))
        # float16 operands, float32 accumulation: where tensor cores make autocast's products.
        cells = {label: flops / timeit(*hgemm_netcl(device, n)) / 1e9
                 for label, device in DEVICES if device.backend == "opencl" and device.tensor_cores}
        if cells and "cuda" in torch_places:
            cells["torch-cuda"] = flops / timeit(*hgemm_torch(n)) / 1e9
        if cells:
            rows.append((f"float16 GEMM n={n} (f32 accumulate)", "GFLOP/s", cells))
    for name in ("small", "large") if (full or any_gpu) else ("small",):
        sizes, batch = mlp_sizes(name)
        cells = {}
        for label, device in DEVICES:
            if name == "small" or full or is_gpu(device):
                cells[label] = batch / timeit(*mlp_step_netcl(device, sizes, batch))
        if name == "small" or full:
            cells["numpy"] = batch / timeit(*mlp_step_numpy(sizes, batch))
        for where in torch_places:
            if name == "small" or full or where == "cuda":
                cells[f"torch-{where}"] = batch / timeit(*mlp_step_torch(sizes, batch, where))
        rows.append((f"MLP {'-'.join(map(str, sizes))} b={batch} step", "samples/s", cells))
        # float32 against autocast + AMPGradScaler on the same device, one after the other.
        for label, device in DEVICES:
            if device.backend == "opencl" and (name == "small" or full or is_gpu(device)):
                compared = mlp_amp_comparison(device, sizes, batch)
                (seconds32, peak32), (seconds16, peak16) = compared[False], compared[True]
                rows.append((f"{label}: MLP {name} step, float32 | autocast", "ms",
                             {label: f"{1e3 * seconds32:.2f} | {1e3 * seconds16:.2f}"}))
                rows.append((f"{label}: MLP {name} pool peak, f32 | autocast", "MiB",
                             {label: f"{peak32 / 2 ** 20:.0f} | {peak16 / 2 ** 20:.0f}"}))
        if "cuda" in torch_places:
            compared = mlp_torch_amp_comparison(sizes, batch)
            (seconds32, peak32), (seconds16, peak16) = compared[False], compared[True]
            rows.append((f"torch-cuda: MLP {name} step, float32 | autocast", "ms",
                         {"torch-cuda": f"{1e3 * seconds32:.2f} | {1e3 * seconds16:.2f}"}))
            rows.append((f"torch-cuda: MLP {name} peak, f32 | autocast", "MiB",
                         {"torch-cuda": f"{peak32 / 2 ** 20:.0f} | {peak16 / 2 ** 20:.0f}"}))
    cells = {}
    for label, device in DEVICES:  # examples/gpt_char.py's default model
        fn, sync, tokens = gpt_step_netcl(device)
        cells[label] = tokens / timeit(fn, sync)
    for where in torch_places:
        fn, sync, tokens = gpt_step_torch(where)
        cells[f"torch-{where}"] = tokens / timeit(fn, sync)
    rows.append(("GPT char, 4x128, T=64, b=32, train step", "tokens/s", cells))
    for label, device in DEVICES:  # the same under autocast, where it changes anything
        if device.backend == "opencl" and device.autocast_half:
            seconds32, seconds16 = (timeit(*gpt_step_netcl(device, amp)[:2]) for amp in (False, True))
            rows.append((f"{label}: GPT step, float32 | autocast", "ms",
                         {label: f"{1e3 * seconds32:.2f} | {1e3 * seconds16:.2f}"}))
    if "cuda" in torch_places:
        seconds32, seconds16 = (timeit(*gpt_step_torch("cuda", amp)[:2]) for amp in (False, True))
        rows.append(("torch-cuda: GPT step, float32 | autocast", "ms",
                     {"torch-cuda": f"{1e3 * seconds32:.2f} | {1e3 * seconds16:.2f}"}))
    cells = {label: CONV_FLOPS / timeit(*conv_netcl(device)) / 1e9 for label, device in DEVICES}
    cells["numpy"] = CONV_FLOPS / timeit(*conv_numpy()) / 1e9
    for where in torch_places:
        cells[f"torch-{where}"] = CONV_FLOPS / timeit(*conv_torch(where)) / 1e9
    rows.append(("conv2d fwd+bwd (64,32,28,28) 64x3x3 pad 1", "GFLOP/s", cells))
    for label, device in DEVICES:  # the same under autocast, where it changes anything
        if device.backend == "opencl" and device.autocast_half:
            seconds32, seconds16 = (timeit(*conv_netcl(device, amp)) for amp in (False, True))
            rows.append((f"{label}: conv2d fwd+bwd, float32 | autocast", "ms",
                         {label: f"{1e3 * seconds32:.3f} | {1e3 * seconds16:.3f}"}))
    if "cuda" in torch_places:
        seconds32, seconds16 = (timeit(*conv_torch("cuda", amp)) for amp in (False, True))
        rows.append(("torch-cuda: conv2d fwd+bwd, float32 | autocast", "ms",
                     {"torch-cuda": f"{1e3 * seconds32:.3f} | {1e3 * seconds16:.3f}"}))
    cells = {label: 1.0 / timeit(*adamw_step_netcl(device)) for label, device in DEVICES}
    for where in torch_places:
        cells[f"torch-{where}"] = 1.0 / timeit(*adamw_step_torch(where))
    rows.append(("AdamW step(max_norm=1) alone, MLP small", "steps/s", cells))
    for dataset in ("digits", "synthetic"):
        cells, syncs = {}, {}
        for label, device in DEVICES:
            cells[label], syncs[label] = fit_figures(device, dataset)
        rows.append((f"Trainer.fit epoch, {dataset}", "samples/s", cells))
        rows.append((f"Trainer.fit epoch, {dataset}", "syncs/100 steps",
                     {label: f"{v:.1f}" for label, v in syncs.items()}))
    has_opencl = any(d.backend == "opencl" for _, d in DEVICES)
    for label, kwargs, on_device in LOADER_CONFIGS:
        if not on_device or has_opencl:
            fn, sync = loader_epoch(kwargs, on_device)
            seconds = timeit(fn, sync, min_seconds=0, min_calls=3, warmup=1)
            rows.append((f"DataLoader epoch, {label}", "samples/s",
                         {"netcl-opencl" if on_device else "netcl-cpu": LOADER_SAMPLES / seconds}))
    for label, device in DEVICES:
        sizes, batch = mlp_sizes("small")
        syncs, launches = syncs_per_step(device, sizes, batch)
        rows.append((f"{label}: launch overhead per op", "µs", {label: launch_overhead(device)}))
        rows.append((f"{label}: MLP small step", "syncs, launches",
                     {label: f"{syncs:g} syncs, {launches:g} launches"}))
        if device.backend == "opencl":
            syncs, launches = syncs_per_step(device, sizes, batch, amp=True)
            rows.append((f"{label}: MLP small step, autocast", "syncs, launches",
                         {label: f"{syncs:g} syncs, {launches:g} launches"}))
        rows.append((f"{label}: pool peak", "MiB",
                     {label: device.pool.stats()["peak_bytes"] / 2 ** 20}))
    return rows


def print_table(rows):
    columns = []
    for _, _, cells in rows:
        columns += [c for c in cells if c not in columns]
    print(f"netcl benchmarks — {platform.node()}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"devices: {', '.join(f'{l} = {d.name}' for l, d in DEVICES)}")
    header = f"{'workload':44} {'unit':16}" + "".join(f"{c:>16}" for c in columns)
    print(header)
    print("-" * len(header))
    for workload, unit, cells in rows:
        line = f"{workload:44} {unit:16}"
        for c in columns:
            value = cells.get(c, "")
            line += f"{value:>16.1f}" if isinstance(value, float) else f"{value:>16}"
        print(line)
        numbers = {c: v for c, v in cells.items() if isinstance(v, float)}
        if "numpy" in numbers and len(numbers) > 1:
            ratios = ", ".join(f"{c} {v / numbers['numpy']:.2f}x" for c, v in numbers.items()
                               if c != "numpy")
            print(f"{'':61}vs numpy: {ratios}")
        torch_ref = numbers.get("torch-cuda") or numbers.get("torch-cpu")
        if torch_ref and any(c.startswith("netcl") for c in numbers):
            ratios = ", ".join(f"{c} {v / torch_ref:.2f}x" for c, v in numbers.items()
                               if c.startswith("netcl"))
            ref = "torch-cuda" if numbers.get("torch-cuda") else "torch-cpu"
            print(f"{'':61}vs {ref}: {ratios}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="large workloads on CPU devices too")
    parser.add_argument("--json", metavar="PATH", help="save the figures as JSON")
    parser.add_argument("--kernels", choices=PROFILED, help="instead of the table: one "
                        "workload's step on the OpenCL device, kernel by kernel")
    parser.add_argument("--amp", action="store_true", help="with --kernels: under autocast")
    args = parser.parse_args(argv)
    if args.kernels:
        print_kernel_profile(args.kernels, netcl.manager.default("opencl"), args.amp)
        return
    rows = measure(full=args.full)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"workload": w, "unit": u, "values": c} for w, u, c in rows], f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
