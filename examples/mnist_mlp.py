"""MNIST with an MLP: the explicit training loop, then the same model with Trainer.

Part 1 shows every piece of a training step in plain sight:

    with netcl.Tape() as tape:        # record the forward pass
        loss = cross_entropy(model(x), y)
    opt.zero_grad()                   # forget last step's gradients
    tape.backward(loss)               # walk the recorded graph backwards
    opt.step()                        # SGD with momentum updates the weights

Part 2 trains a fresh copy of the same model with `netcl.trainer.Trainer`: AdamW with
gradient clipping fused into its step, a DataLoader, a validation split, and the best
epoch's weights saved to a checkpoint, then reports the test accuracy of that checkpoint.

By default it uses the 8x8 handwritten digits that scikit-learn ships (1797 images, a
64-128-10 network, about 97-99% test accuracy in a few seconds). Give `--data DIR` with the
four MNIST IDX files (`train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
`t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`, or with a dot before `idx`, as in
`train-images.idx3-ubyte`; each optionally `.gz`) to train a 784-256-10 network on MNIST
instead. `--model cnn` trains a small convolutional network
(conv-relu-pool twice, then a linear classifier) on the same images, seen as 1 x side x side.

    python examples/mnist_mlp.py                    # NETCL_DEVICE or auto
    python examples/mnist_mlp.py --device opencl    # any OpenCL device, PoCL too
    python examples/mnist_mlp.py --model cnn        # the small CNN (about 99%)
    python examples/mnist_mlp.py --data ~/mnist --epochs 5
    mpiexec -n 2 python examples/mnist_mlp.py --distributed   # data-parallel, 2 ranks

It runs from a checkout without installing netcl: the netcl.py one directory up comes first
on the path (scikit-learn is in the `examples` extra).
"""

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import netcl  # noqa: E402  (the checkout's netcl when run from it, else the installed one)
from netcl.data.dataloader import DataLoader  # noqa: E402
from netcl.optim import AdamW  # noqa: E402
from netcl.trainer import Trainer  # noqa: E402


def load_mnist(directory):
    """The four MNIST IDX files -> (x_train, y_train, x_test, y_test), pixels in [0, 1]."""
    def read(stem, idx):  # e.g. "train-images", "idx3"
        # LeCun's names have a dash before idx, many copies a dot; either may be gzipped.
        names = [f"{stem}{sep}{idx}-ubyte{gz}" for sep in ("-", ".") for gz in ("", ".gz")]
        for name in names:
            path = os.path.join(directory, name)
            if os.path.exists(path):
                return netcl.load_idx(path)
        raise FileNotFoundError(f"no MNIST file {stem} in {directory}; tried {', '.join(names)}")

    x_train = read("train-images", "idx3").reshape(-1, 28 * 28) / 255.0
    x_test = read("t10k-images", "idx3").reshape(-1, 28 * 28) / 255.0
    return x_train, read("train-labels", "idx1"), x_test, read("t10k-labels", "idx1")


def load_digits(seed):
    """scikit-learn's 8x8 digits, split 80/20 -> (x_train, y_train, x_test, y_test)."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = digits.data / 16.0  # pixels are 0..16
    order = np.random.default_rng(seed).permutation(len(x))
    n_train = int(0.8 * len(x))
    train, test = order[:n_train], order[n_train:]
    return x[train], digits.target[train], x[test], digits.target[test]


def build_model(kind, pixels, queue):
    """The MLP (pixels-hidden-10), or the CNN on (N, 1, side, side) images."""
    nn = netcl.nn
    if kind == "cnn":
        side = math.isqrt(pixels)
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1, queue=queue), nn.ReLU(), nn.MaxPool2d(2),   # 16 x side/2
            nn.Conv2d(16, 32, 3, padding=1, queue=queue), nn.ReLU(), nn.MaxPool2d(2),  # 32 x side/4
            nn.Flatten(), nn.Linear(32 * (side // 4) ** 2, 10, queue=queue))
    hidden = 256 if pixels > 64 else 128
    return nn.Sequential(nn.Linear(pixels, hidden, queue=queue), nn.ReLU(),
                         nn.Linear(hidden, 10, queue=queue))


def accuracy(model, x, y, device, batch_size=1000):
    """Fraction of correctly classified samples; no Tape, so nothing is recorded."""
    model.eval()
    correct = 0
    for start in range(0, len(x), batch_size):
        xb = netcl.Tensor.from_host(x[start:start + batch_size], queue=device.queue)
        logits = model(xb).value.to_host()
        correct += int((logits.argmax(axis=1) == y[start:start + batch_size]).sum())
    model.train()
    return correct / len(x)


def train_with_tape(args, device, data):
    """Part 1: the explicit loop, SGD with momentum."""
    x_train, y_train, x_test, y_test = data
    netcl.manual_seed(args.seed)  # reproducible initialisation
    # The model lives on the device: its parameters are created on device.queue.
    model = build_model(args.model, args.pixels, device.queue)
    opt = netcl.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if args.distributed:  # gradients averaged over the ranks before each step
        opt = netcl.distributed.DistributedOptimizer(opt)

    rng = np.random.default_rng(args.seed)
    for epoch in range(1, args.epochs + 1):
        started = time.perf_counter()
        order = rng.permutation(len(x_train))  # a new shuffle every epoch
        # This rank's share (all of it in one process); the same seed, the same permutation.
        order = order[netcl.distributed.rank()::netcl.distributed.world_size()]
        losses = []
        for start in range(0, len(order), args.batch_size):
            batch = order[start:start + args.batch_size]
            xb = netcl.Tensor.from_host(x_train[batch], queue=device.queue)  # (B, pixels)
            yb = netcl.Tensor.from_host(y_train[batch], queue=device.queue)  # (B,) int32

            with netcl.Tape() as tape:
                logits = model(xb)  # (B, 10)
                loss = netcl.functional.cross_entropy(logits, yb)
            opt.zero_grad()
            tape.backward(loss)
            opt.step()
            losses.append(loss)  # read back once per epoch, not once per step

        mean_loss = np.mean([float(loss.value.to_host()) for loss in losses])
        print(f"epoch {epoch:2d}  loss {mean_loss:.4f}  test accuracy "
              f"{accuracy(model, x_test, y_test, device):.2%}  "
              f"({time.perf_counter() - started:.1f} s)")
    return accuracy(model, x_test, y_test, device)


def train_with_trainer(args, device, data):
    """Part 2: the same model with Trainer, AdamW and clipping, keeping the best epoch."""
    x_train, y_train, x_test, y_test = data
    n_val = len(x_train) // 10  # the last tenth of the training set picks the best epoch
    train_set = netcl.ArrayDataset(x_train[:-n_val], y_train[:-n_val])
    val_set = netcl.ArrayDataset(x_train[-n_val:], y_train[-n_val:])

    netcl.manual_seed(args.seed)
    model = build_model(args.model, args.pixels, device.queue)
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    trainer = Trainer(model, opt, device_queue=device.queue, grad_clip=1.0, metrics_stride=10)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, seed=args.seed)
    val_loader = DataLoader(val_set, batch_size=256, shuffle=False)
    history = trainer.fit(train_loader, val_loader, epochs=args.epochs,
                          checkpoint=args.checkpoint)
    best = max(history, key=lambda h: h["val_accuracy"])
    print(f"best validation accuracy {best['val_accuracy']:.2%} at epoch {best['epoch']}, "
          f"saved to {args.checkpoint}")
    if args.plot and netcl.distributed.is_main():
        history.plot(args.plot)  # loss and accuracy per epoch (needs matplotlib)
        print(f"history plotted to {args.plot}")

    if netcl.distributed.is_main():  # rank 0 wrote it: it reads it, and hands it to the others
        model.load_state_dict(netcl.load(args.checkpoint))  # the best epoch's weights
    netcl.distributed.broadcast_parameters(model)
    test_loader = DataLoader(netcl.ArrayDataset(x_test, y_test), batch_size=256, shuffle=False)
    return trainer.evaluate(test_loader)["accuracy"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="directory with the MNIST IDX files "
                                       "(default: scikit-learn's digits)")
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05, help="part 1's SGD learning rate")
    parser.add_argument("--device", default=None,
                        help="cpu, gpu, opencl, opencl:P:D or auto "
                             "(default: $NETCL_DEVICE, else auto)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="mnist_mlp.npz",
                        help="where part 2 saves the best model's state_dict")
    parser.add_argument("--plot", metavar="PNG",
                        help="draw part 2's History (loss, accuracy per epoch) there; "
                             "needs matplotlib")
    parser.add_argument("--distributed", action="store_true",
                        help="data-parallel over the ranks of mpiexec -n N; --batch-size is per rank")
    args = parser.parse_args()

    if args.distributed:
        netcl.distributed.init()  # before the device: each rank picks its own
        if not netcl.distributed.is_main():
            sys.stdout = open(os.devnull, "w")  # one rank reports
    device = netcl.manager.default(args.device)
    print(f"device: {device.name} ({device.backend})")
    if args.data:
        x_train, y_train, x_test, y_test = load_mnist(args.data)
    else:
        x_train, y_train, x_test, y_test = load_digits(args.seed)
    args.pixels = x_train.shape[1]
    x_train, x_test = x_train.astype(np.float32), x_test.astype(np.float32)
    y_train, y_test = y_train.astype(np.int32), y_test.astype(np.int32)
    if args.model == "cnn":  # images as (N, 1, side, side)
        side = math.isqrt(args.pixels)
        x_train, x_test = x_train.reshape(-1, 1, side, side), x_test.reshape(-1, 1, side, side)
    print(f"data: {len(x_train)} training and {len(x_test)} test images of {args.pixels} pixels")
    data = (x_train, y_train, x_test, y_test)

    print("\npart 1: an explicit Tape loop with SGD")
    tape_accuracy = train_with_tape(args, device, data)
    print("\npart 2: the same model with Trainer, AdamW and gradient clipping")
    trainer_accuracy = train_with_trainer(args, device, data)
    print(f"\ntest accuracy: Tape loop {tape_accuracy:.2%}, Trainer {trainer_accuracy:.2%}")


if __name__ == "__main__":
    main()
