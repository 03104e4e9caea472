"""Weight sync: seconds and GB/s per transport against model size, next to a plain memory copy
and a raw gloo broadcast of the same bytes, all measured in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/weight_sync.py [--sizes 6M,40M,150M,0.5B]
        [--reps 3] [--append]

For each size a Qwen2-shape model with random weights is saved, a local Ray places 2 FSDP2
trainer ranks and 1 engine worker (the transformers engine, whose weight load is a plain
``load_state_dict`` copy, so the numbers are the transport's rather than an engine's re-packing),
and each transport syncs ``reps`` times after one warm-up (median reported, the checksum verified
every time):

- ``in_process``: single-process mode; trainer and engine in this process.
- ``shared_memory``: rank 0 gathers the shards into buckets in a shared-memory file it keeps; the
  engine maps the file once and loads from it (``treadle/cluster/shared_buckets.py``).
- ``collective``: each trainer rank sends its own pieces point to point over a gloo group into
  the engine's 64 MiB buckets (``treadle/cluster/piece_sync.py``).
- ``disk``: rank 0 writes a safetensors file, the engine reads it.

Baselines on the same bytes: ``memcpy`` (one ``copy_`` of a flat buffer in this process) and
``gloo broadcast`` (two fresh processes broadcasting the buffer in the same buckets, nothing
else). Prints a markdown table and writes ``bench/weight_sync.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import report
import torch
from shapes import random_qwen2

VOCAB = {"6M": 4096, "40M": 16384, "150M": 32768, "0.5B": 151936}
BUCKET_MB = 64


def build(name: str, folder: Path) -> int:
    from treadle.store.models import build_tokenizer

    model = random_qwen2(name, VOCAB[name])
    model.save_pretrained(folder)
    build_tokenizer(["a b c"], 300).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def median_time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Peer:
    """A bare process of a 2-rank gloo group: the raw-broadcast baseline."""

    def join(self, host, port, rank, prefix):
        from treadle.cluster.buckets import new_sync_group

        torch.set_num_threads(1)
        self.group = new_sync_group(host, port, rank, 2, prefix)

    def broadcast(self, nbytes: int, bucket_bytes: int, reps: int) -> list[float]:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        buffers = [
            torch.ones(min(bucket_bytes, nbytes - off) // 4, dtype=torch.float32)
            for off in range(0, nbytes, bucket_bytes)
        ]
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for b in buffers:
                self.group.broadcast([b], options).wait()
            times.append(time.perf_counter() - t0)
        return times[1:]


def memcpy(nbytes: int, reps: int) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return median_time(lambda: dst.copy_(src), reps)


def raw_broadcast(nbytes: int, reps: int) -> float:
    import ray

    from treadle.cluster.placement import free_port

    peer = ray.remote(num_cpus=0)(_Peer)
    a, b = peer.remote(), peer.remote()
    port = free_port()
    ray.get(
        [a.join.remote("127.0.0.1", port, 0, "raw"), b.join.remote("127.0.0.1", port, 1, "raw")]
    )
    out = ray.get([p.broadcast.remote(nbytes, BUCKET_MB * 2**20, reps) for p in (a, b)])
    for p in (a, b):
        ray.kill(p)
    return statistics.median(max(x, y) for x, y in zip(*out, strict=True))


def measure(name: str, reps: int, tmp: Path) -> dict:
    from treadle.cluster import close_ray_roles
    from treadle.cluster.engine_group import EngineGroup
    from treadle.cluster.placement import place
    from treadle.cluster.trainer_group import TrainerGroup
    from treadle.cluster.transports import RaySync
    from treadle.config import PlacementConfig, TrainerConfig
    from treadle.core.protocols import EngineSpec
    from treadle.rollout.engines import build_engine
    from treadle.store.models import load_model
    from treadle.train.torch_backend import TorchBackend
    from treadle.train.weight_sync import InProcessSync

    folder = tmp / name
    params = build(name, folder)
    spec = EngineSpec(str(folder), max_model_len=512)
    row: dict = {"model": name, "parameters": params}

    # in-process (single-process mode)
    model, _ = load_model(folder, "float32")
    policy = TorchBackend(model, TrainerConfig(), 10)
    engine = build_engine("hf", spec)
    sync = InProcessSync(policy, engine)
    version = iter(range(1, 10**6))
    row["bytes"] = int(sync.sync(0)["sync/bytes"])
    row["in_process"] = median_time(lambda: sync.sync(next(version)), reps)
    del model, policy, engine, sync

    row["memcpy"] = memcpy(row["bytes"], reps)
    row["gloo_broadcast"] = raw_broadcast(row["bytes"], reps)

    cfg = PlacementConfig(mode="disaggregated", trainers=2, engines=1)
    placement = place(cfg)
    trainers = TrainerGroup(cfg, placement, folder, TrainerConfig(), 10, 1.0)
    engines = EngineGroup("hf", spec, placement, 1)
    for transport in ("shared_memory", "collective", "disk"):
        sync = RaySync(transport, trainers, engines, "float32", BUCKET_MB, disk_dir=tmp / "disk")
        row[transport] = median_time(lambda s=sync: s.sync(next(version)), reps)
    close_ray_roles(trainers, engines)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default=",".join(VOCAB))
    parser.add_argument("--reps", type=int, default=3)
    report.add_append_flag(parser)
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    torch.set_num_threads(1)
    rows = []
    columns = ["in_process", "shared_memory", "collective", "disk", "memcpy", "gloo_broadcast"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sizes.split(","):
            row = measure(name, args.reps, Path(tmp))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    header = ["model", "params", "GB", *columns, "shared_memory / gloo", "collective / gloo"]
    lines = []
    for row in rows:
        gb = row["bytes"] / 1e9
        cells = [f"{row[c]:.3f} s ({gb / row[c]:.2f})" for c in columns]
        ratios = [f"{row['gloo_broadcast'] / row[t]:.2f}" for t in ("shared_memory", "collective")]
        lines.append(
            [row["model"], f"{row['parameters'] / 1e6:.0f}M", f"{gb:.2f}", *cells, *ratios]
        )
    md = f"seconds (GB/s); medians of {args.reps} after a warm-up\n\n" + report.table(header, lines)
    out = {"reps": args.reps, "rows": rows}
    report.emit("Weight sync", md, out, Path(__file__).with_suffix(".json"), append=args.append)
    ray.shutdown()


if __name__ == "__main__":
    main()
