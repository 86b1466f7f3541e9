"""MNIST with an MLP: the explicit training loop.

This tutorial trains a two-layer perceptron on handwritten digits with netcl and
shows every piece of a training step in plain sight:

    with netcl.Tape() as tape:        # record the forward pass
        loss = cross_entropy(model(x), y)
    opt.zero_grad()                   # forget last step's gradients
    tape.backward(loss)               # walk the recorded graph backwards
    opt.step()                        # SGD with momentum updates the weights

By default it uses the 8x8 handwritten digits that scikit-learn ships (1797
images, a 64-128-10 network, 96-99% test accuracy in a few seconds). Give
`--data DIR` with the four MNIST IDX files (`train-images-idx3-ubyte`,
`train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`,
each optionally `.gz`) to train a 784-256-10 network on MNIST instead.
`--model cnn` trains a small convolutional network (conv-relu-pool twice, then a
linear classifier) on the same images, seen as 1 x side x side.

    python examples/mnist_mlp.py                    # NETCL_DEVICE or auto
    python examples/mnist_mlp.py --device opencl    # any OpenCL device, PoCL too
    python examples/mnist_mlp.py --model cnn        # the small CNN (about 99%)
    python examples/mnist_mlp.py --data ~/mnist --epochs 5

The best model so far (by test accuracy) is saved with `netcl.save` to
`--checkpoint` (default `mnist_mlp.npz`); `netcl.load` reads it back into
`model.load_state_dict`.
"""

import argparse
import gzip
import math
import os
import time

import numpy as np

import netcl


def read_idx(path):
    """Read one MNIST IDX file (plain or .gz) of unsigned bytes into an ndarray."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    # Header: two zero bytes, a type code (0x08 = uint8), the number of
    # dimensions, then each dimension as a big-endian uint32.
    if len(raw) < 4 or raw[:3] != b"\x00\x00\x08" or len(raw) < 4 + 4 * raw[3]:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes")
    ndim = raw[3]
    shape = tuple(int(size) for size in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: expected {shape} values, found {data.size}")
    return data.reshape(shape)


def load_mnist(directory):
    """The four MNIST IDX files -> (x_train, y_train, x_test, y_test), pixels in [0, 1]."""
    def read(name):
        for candidate in (name, name + ".gz"):
            path = os.path.join(directory, candidate)
            if os.path.exists(path):
                return read_idx(path)
        raise FileNotFoundError(f"{name}[.gz] not found in {directory}")

    x_train = read("train-images-idx3-ubyte").reshape(-1, 28 * 28) / 255.0
    x_test = read("t10k-images-idx3-ubyte").reshape(-1, 28 * 28) / 255.0
    y_train = read("train-labels-idx1-ubyte")
    y_test = read("t10k-labels-idx1-ubyte")
    return x_train, y_train, x_test, y_test


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="directory with the MNIST IDX files "
                                       "(default: scikit-learn's digits)")
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--device", default=None,
                        help="cpu, gpu, opencl, opencl:P:D or auto "
                             "(default: $NETCL_DEVICE, else auto)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="mnist_mlp.npz",
                        help="where the best model's state_dict is saved")
    args = parser.parse_args()

    device = netcl.manager.default(args.device)
    print(f"device: {device.name} ({device.backend})")
    netcl.manual_seed(args.seed)  # reproducible initialisation

    if args.data:
        x_train, y_train, x_test, y_test = load_mnist(args.data)
    else:
        x_train, y_train, x_test, y_test = load_digits(args.seed)
    pixels = x_train.shape[1]
    x_train = x_train.astype(np.float32)
    x_test = x_test.astype(np.float32)
    y_train = y_train.astype(np.int32)
    if args.model == "cnn":  # images as (N, 1, side, side)
        side = math.isqrt(pixels)
        x_train, x_test = x_train.reshape(-1, 1, side, side), x_test.reshape(-1, 1, side, side)
    print(f"data: {len(x_train)} training and {len(x_test)} test images "
          f"of {pixels} pixels")

    # The model lives on the device: its parameters are created on device.queue.
    model = build_model(args.model, pixels, device.queue)
    opt = netcl.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    rng = np.random.default_rng(args.seed)
    best = -1.0
    for epoch in range(1, args.epochs + 1):
        started = time.perf_counter()
        order = rng.permutation(len(x_train))  # a new shuffle every epoch
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

            # to_host() waits for this step to finish on the device; a tutorial
            # can afford it, a fast loop would read the loss only now and then.
            losses.append(float(loss.value.to_host()))

        test_accuracy = accuracy(model, x_test, y_test, device)
        seconds = time.perf_counter() - started
        print(f"epoch {epoch:2d}  loss {np.mean(losses):.4f}  "
              f"test accuracy {test_accuracy:.2%}  ({seconds:.1f} s)")
        if test_accuracy > best:
            best = test_accuracy
            netcl.save(model.state_dict(), args.checkpoint)

    print(f"final test accuracy: {test_accuracy:.2%} "
          f"(best {best:.2%}, saved to {args.checkpoint})")


if __name__ == "__main__":
    main()
