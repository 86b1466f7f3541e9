"""Data-parallel scaling: samples/s of one rank and of N ranks, and what the ranks exchange.

Runs itself under `mpiexec -n 1` and `mpiexec -n N` (N = --ranks), each rank training the
same MLP on its own batches of --batch-size samples (weak scaling: N ranks take N times the
samples per step) with AdamW, gradient clipping and a DistributedOptimizer, and prints per
run: samples/s of the whole job, the scaling efficiency (samples/s over N times one rank's),
the seconds per step spent inside the gradient all-reduce, and the collectives per step.

    python examples/bench_distributed.py                      # NumPy backend, 1 vs 2 ranks
    python examples/bench_distributed.py --device opencl --ranks 4

Each rank gets one BLAS thread (OMP_NUM_THREADS=1 unless set), so N ranks use N cores.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np


def worker(args):
    """One rank: time --steps training steps after --warmup ones; rank 0 prints a JSON line."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import netcl

    dist = netcl.distributed
    dist.init()
    device = netcl.manager.default(args.device)
    queue = device.queue
    sizes = [int(s) for s in args.sizes.split("-")]
    netcl.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        layers += [netcl.nn.Linear(fan_in, fan_out, queue=queue), netcl.nn.ReLU()]
    model = netcl.nn.Sequential(*layers[:-1])
    opt = dist.DistributedOptimizer(netcl.optim.AdamW(model.parameters(), lr=1e-3))
    rng = np.random.default_rng(dist.rank())
    x = netcl.Tensor.from_host(rng.normal(size=(args.batch_size, sizes[0])).astype(np.float32), queue)
    y = netcl.Tensor.from_host(rng.integers(0, sizes[-1], size=args.batch_size), queue)

    def step():
        with netcl.Tape() as tape:
            loss = netcl.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        tape.backward(loss)
        opt.step(max_norm=1.0)

    for _ in range(args.warmup):
        step()
    device.finish()
    before = dist.stats()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    device.finish()  # the last step's update, before the clock stops
    seconds = time.perf_counter() - started
    after = dist.stats()
    if dist.is_main():
        delta = {key: after[key] - before[key] for key in after}
        others = delta["metric_allreduces"] + delta["broadcasts"]
        print("RESULT " + json.dumps({
            "ranks": dist.world_size(), "device": device.name,
            "samples_per_s": dist.world_size() * args.batch_size * args.steps / seconds,
            "comm_ms_per_step": 1e3 * delta["gradient_seconds"] / args.steps,
            "allreduces_per_step": delta["gradient_allreduces"] / args.steps,
            "mib_per_step": delta["gradient_bytes"] / args.steps / 2**20,
            "other_collectives": others}), flush=True)


def launch(args, ranks):
    """Run this script's worker under mpiexec -n ranks; its RESULT line as a dict."""
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    mpiexec = shutil.which("mpiexec", path=search)
    if mpiexec is None:
        sys.exit("mpiexec not found: python -m pip install mpi4py mpich")
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(name, "1")
    env.setdefault("POCL_MAX_PTHREAD_COUNT", "1")
    command = [mpiexec, "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--worker"]
    command += [f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items()
                if key not in ("worker", "ranks") and value is not None]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="N, compared with 1 rank")
    parser.add_argument("--device", default=None, help="cpu, opencl, ... (default: NETCL_DEVICE "
                                                       "or auto)")
    parser.add_argument("--sizes", default="784-256-256-10", help="the MLP's layer widths")
    parser.add_argument("--batch-size", type=int, default=128, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    results = [launch(args, 1), launch(args, args.ranks)]
    print(f"MLP {args.sizes}, batch {args.batch_size} per rank, AdamW + clip, "
          f"{results[0]['device']}")
    print(f"{'ranks':>5} {'samples/s':>10} {'efficiency':>10} {'all-reduce ms/step':>18} "
          f"{'all-reduces/step':>16} {'MiB/step':>8} {'other collectives':>17}")
    for result in results:
        efficiency = result["samples_per_s"] / (result["ranks"] * results[0]["samples_per_s"])
        print(f"{result['ranks']:>5} {result['samples_per_s']:>10.0f} {efficiency:>10.0%} "
              f"{result['comm_ms_per_step']:>18.2f} {result['allreduces_per_step']:>16.1f} "
              f"{result['mib_per_step']:>8.2f} {result['other_collectives']:>17}")


if __name__ == "__main__":
    main()
