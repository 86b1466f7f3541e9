"""A small CNN on scikit-learn's handwritten digits (8x8 images, as 1x8x8), trained with an
explicit Tape loop and SGD with momentum; prints the test accuracy.

    python examples_cnn_snippet.py [--device cpu|opencl|auto] [--epochs 20]
"""
import argparse
import time

import numpy as np
from sklearn.datasets import load_digits

import netcl
from netcl import functional as F, nn


def cnn(queue):
    """conv-relu-pool twice, then a linear classifier: (N, 1, 8, 8) -> (N, 10)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, queue=queue), nn.ReLU(), nn.MaxPool2d(2),   # 16x4x4
        nn.Conv2d(16, 32, 3, padding=1, queue=queue), nn.ReLU(), nn.MaxPool2d(2),  # 32x2x2
        nn.Flatten(), nn.Linear(32 * 2 * 2, 10, queue=queue))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu, opencl or auto (default: "
                                                       "NETCL_DEVICE, else auto)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(images))  # fixed 80/20 split
    split = int(0.8 * len(images))
    train, test = order[:split], order[split:]

    device = netcl.manager.default(args.device)
    print(f"device: {device.backend} ({device.name})")
    netcl.manual_seed(0)
    model = cnn(device.queue)
    optimizer = netcl.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    shuffle = np.random.default_rng(1)

    for epoch in range(1, args.epochs + 1):
        started, total_loss = time.perf_counter(), 0.0
        model.train()
        batches = np.array_split(shuffle.permutation(train), -(-len(train) // args.batch_size))
        for batch in batches:
            xb = netcl.Tensor.from_host(images[batch], device.queue)
            with netcl.Tape() as tape:
                loss = F.cross_entropy(model(xb), labels[batch])
            optimizer.zero_grad()
            tape.backward(loss)
            optimizer.step()
            total_loss += float(loss.value.to_host()) * len(batch)  # a sync, for the log
        print(f"epoch {epoch:2d}  loss {total_loss / len(train):.4f}  "
              f"{time.perf_counter() - started:.2f} s")

    model.eval()
    with netcl.no_grad():
        logits = model(netcl.Tensor.from_host(images[test], device.queue)).value.to_host()
    accuracy = float((logits.argmax(axis=1) == labels[test]).mean())
    print(f"test accuracy: {accuracy:.4f} ({len(test)} images)")


if __name__ == "__main__":
    main()
