"""Mirror throughput vs a plain copy of the same files with the same client, same S3 server, same run.

A synthetic committed checkpoint (random shards plus a manifest) is uploaded to a moto S3 server on
127.0.0.1 in alternating (ABBA) blocks, each to a fresh prefix that is deleted afterwards:

- trainguard: ``mirror_checkpoint`` — every file read and hashed (xxh3 against the manifest, MD5 for
  the ETag), uploaded, verified (ETag, or read back where the ETag is no MD5), manifest last;
- baseline: ``fs.put(local_files, remote_paths)`` — s3fs's own concurrent upload of the same files.

Throughput is checkpoint bytes / wall seconds; the target is trainguard ≥ 0.8 × baseline.
Usage: ``python benchmarks/backup.py [--quick] [--files 8] [--mb 32] [--cycles 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' helpers package

from common import median, schedule  # noqa: E402
from helpers.s3_server import start_s3_server  # noqa: E402

TARGET = 0.8


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 files of 8 MB, 1 cycle (under a minute)")
    p.add_argument("--files", type=int, default=8, help="shards in the checkpoint")
    p.add_argument("--mb", type=int, default=32, help="megabytes (10^6 bytes) per shard")
    p.add_argument("--cycles", type=int, default=2, help="ABBA cycles (each times both sides twice)")
    p.add_argument("--workers", type=int, default=8, help="files the mirror uploads at once")
    args = p.parse_args()
    if args.quick:
        args.files, args.mb, args.cycles = 4, 8, 1
    return args


def make_checkpoint(root: Path, files: int, size: int) -> Path:
    from trainguard.checkpoint.manifest import build_manifest, write_manifest

    ckpt = root / "global_step_1000"
    ckpt.mkdir(parents=True)
    for i in range(files):
        (ckpt / f"__{i}_0.distcp").write_bytes(os.urandom(size))
    write_manifest(ckpt, build_manifest(ckpt, step=1000, world_size=files, mesh_shape=[files],
                                        mesh_dim_names=["dp_shard"], trainer_state={"step": 1000}))
    return ckpt


def main() -> None:
    args = parse_args()
    from trainguard.backup.mirror import mirror_checkpoint
    from trainguard.backup.url import Mirror, open_mirror
    from trainguard.checkpoint.manifest import read_manifest

    server = start_s3_server("bench")
    os.environ.update(server.env())
    work = Path(tempfile.mkdtemp(prefix="trainguard-backup-bench-"))
    try:
        ckpt = make_checkpoint(work, args.files, args.mb * 10**6)
        total = read_manifest(ckpt).total_size
        mirror = open_mirror("s3://bench/warmup")
        fs = mirror.fs
        local = sorted(str(p) for p in ckpt.iterdir() if p.name != "trainguard.json")

        def run(mode: str, index: int) -> float:
            prefix = f"bench/{mode}-{index}"
            started = time.perf_counter()
            if mode == "on":
                # the same client (one S3FileSystem, connections warm) as the baseline
                mirror_checkpoint(ckpt, Mirror(fs=fs, root=prefix, url=f"s3://{prefix}"), workers=args.workers)
            else:
                fs.put(local, [f"{prefix}/global_step_1000/{Path(p).name}" for p in local])
            seconds = time.perf_counter() - started
            fs.rm(prefix, recursive=True)
            return total / seconds / 1e6

        run("on", -1)  # warm-up: connections, imports, page cache
        run("off", -1)
        samples: dict[str, list[float]] = {"on": [], "off": []}
        for index, mode in enumerate(schedule(args.cycles)):
            samples[mode].append(run(mode, index))
        mirror_mb_s, plain_mb_s = median(samples["on"]), median(samples["off"])
        ratio = mirror_mb_s / plain_mb_s
        print(f"\ncheckpoint: {args.files} files × {args.mb} MB = {total / 1e6:.0f} MB; moto S3 on 127.0.0.1; "
              f"{len(samples['on'])} samples per side (ABBA)")
        print(f"{'path':<44}{'MB/s (median)':>15}{'samples':>30}")
        print(f"{'trainguard mirror (hash, upload, verify)':<44}{mirror_mb_s:>15.1f}"
              f"{' '.join(f'{v:.0f}' for v in samples['on']):>30}")
        print(f"{'plain s3fs put of the same files':<44}{plain_mb_s:>15.1f}"
              f"{' '.join(f'{v:.0f}' for v in samples['off']):>30}")
        met = ratio >= TARGET
        print(f"ratio mirror / plain: {ratio:.2f} (target ≥ {TARGET}: {'met' if met else 'MISSED'})")
        print("RESULT " + json.dumps({"figure": "backup mirror throughput vs plain put", "trainguard": round(mirror_mb_s, 2),
                                      "baseline": round(plain_mb_s, 2), "ratio": round(ratio, 3),
                                      "target": f">= {TARGET}", "met": met}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        server.stop()


if __name__ == "__main__":
    main()
