"""Benchmark: ``trainguard ckpt merge`` against a naive merge on the same >= 1 GiB per-rank checkpoint.

The checkpoint: a Llama-shaped model (``--gib`` GiB of fp32 weights) saved the way trainguard's local
tier saves it: 4 ranks, FSDP2 ``Shard(0)`` on a 1-D mesh, ``model_world_size_4_rank_R.pt`` with plain
local tensors, ``fsdp_config.json``, ``huggingface/config.json``. It is generated once, random.

Each merge runs in its own process; the figures are its wall time, its peak RSS (``wait4``'s
``ru_maxrss``) and its work (the time after its imports: what it prints):
- ``trainguard``: ``python -m trainguard ckpt merge --backend fsdp``, the command as users run it
  (streaming, memory-mapped reads, safetensors written tensor by tensor, fsynced before the directory
  is committed);
- ``naive``: load every rank file whole (``torch.load``, weights_only), ``torch.cat`` each tensor's
  shards, ``safetensors.torch.save_file`` of the whole state dict: what verl's merger does. It returns
  with the file still being written back from the page cache;
- ``naive+fsync``: the same, then ``fsync`` of the file: the same durability as trainguard's.
- ``verl``: verl's own merger, ``python -m verl.model_merger merge --backend fsdp``, with the Python
  given by ``--verl-python`` (default ``$VERL_PYTHON``). ``pip install verl`` into the shared
  environment would replace its transformers, huggingface_hub and tokenizers and pull ray, wandb and
  datasets, so verl lives in a side venv that sees the shared torch 2.13.0+cpu and transformers::

      python -m venv /tmp/verlenv
      echo /work/main/.venv/lib/python3.11/site-packages > /tmp/verlenv/lib/python3.11/site-packages/zz_shared.pth
      /tmp/verlenv/bin/pip install --no-deps verl ray tensordict codetiming hydra-core omegaconf \
          antlr4-python3-runtime accelerate pylatexenc cloudpickle orjson pyvers msgpack protobuf

  Without it verl is reported as not run. ``--verl-path DIR`` instead puts ``DIR`` (a ``pip install
  --target`` of verl, as tests/helpers/verl_env.py caches it) first on this Python's ``PYTHONPATH``;
- ``torch-dcp``: PyTorch's own tool, ``consolidate_safetensors_files`` of
  ``torch.distributed.checkpoint._consolidate_hf_safetensors``
  (what ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)`` runs after a
  save), one output file, one thread (the writer's default). Its input is its own format: the same
  state saved by ``dcp.save`` through ``HuggingFaceStorageWriter(save_distributed=True)`` on 4 gloo
  ranks, FSDP2 ``Shard(0)`` DTensors (one sharded safetensors file per rank). That input is written
  once in the setup, not timed. It returns with the file still in the page cache (no fsync);
- ``torch-dcp+fsync``: the same, then ``fsync`` of the file: the same durability as trainguard's.
Each round runs every merge, then again in reverse order; medians are reported. Usage::

    OMP_NUM_THREADS=1 python benchmarks/merge.py [--gib 1] [--rounds 1] [--dir /tmp] [--verl-python PY] [--quick]
"""

from __future__ import annotations

import argparse
import json
import re
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median  # noqa: E402

TARGET_SPEEDUP = 2.0
TARGET_RSS = 0.3
RANKS = 4


def model_config(gib: float) -> dict:
    """Llama shape with about ``gib`` GiB of fp32 parameters (layers added until it is reached)."""
    hidden, inter, vocab = 1024, 2816, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, int(-(-(gib * 2**30 / 4 - fixed) // per_layer)))
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16, vocab_size=vocab,
                max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)


def make_checkpoint(directory: Path, gib: float) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**model_config(gib))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    directory.mkdir(parents=True)
    (directory / "huggingface").mkdir()
    config.save_pretrained(directory / "huggingface")
    _tiny_tokenizer().save_pretrained(directory / "huggingface")  # verl's merger insists on one
    generator = torch.Generator().manual_seed(0)
    total = 0
    for rank in range(RANKS):
        shard = {}
        for name, shape in shapes.items():
            rows = -(-shape[0] // RANKS)
            local = (min(shape[0], (rank + 1) * rows) - min(shape[0], rank * rows), *shape[1:])
            shard[name] = torch.randn(local, generator=generator)
            total += shard[name].numel() * 4
        torch.save(shard, directory / f"model_world_size_{RANKS}_rank_{rank}.pt")
        del shard
    params = {name: {"shape": list(shape), "dtype": "float32", "placements": ["Shard(0)"]}
              for name, shape in shapes.items()}
    (directory / "fsdp_config.json").write_text(json.dumps(
        {"FSDP_version": 2, "world_size": RANKS, "mesh_shape": [RANKS], "mesh_dim_names": ["dp_shard"],
         "params": params}))
    return total


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def naive_merge(source: str, target: str, durable: bool = False) -> None:
    """Load all shards, concatenate, save: the baseline (runs in its own process). ``durable``: then
    fsync the file, as trainguard's merge does before it commits the directory."""
    import torch
    from safetensors.torch import save_file

    started = time.perf_counter()

    shards = [torch.load(Path(source) / f"model_world_size_{RANKS}_rank_{r}.pt", weights_only=True)
              for r in range(RANKS)]
    merged = {name: torch.cat([s[name] for s in shards], dim=0) for name in shards[0]}
    del shards
    Path(target).mkdir()
    save_file(merged, Path(target) / "model.safetensors", metadata={"format": "pt"})
    if durable:
        with open(Path(target) / "model.safetensors", "rb+") as f:
            os.fsync(f.fileno())
    for path in (Path(source) / "huggingface").iterdir():
        shutil.copy(path, Path(target) / path.name)
    print(f"WORK {time.perf_counter() - started}")


def make_dcp_checkpoint(source: Path, directory: Path) -> None:
    """The same state as ``source``'s rank files, saved by torch's DCP Hugging Face writer from 4 gloo
    ranks (each rank's local shard as a ``Shard(0)`` DTensor): the input of torch's consolidation."""
    import torch.multiprocessing as mp

    rendezvous = directory.with_name(f"{directory.name}.rendezvous")  # gloo's file store; it removes it at the end
    mp.spawn(_dcp_save_rank, args=(source, directory, str(rendezvous)), nprocs=RANKS, join=True)


def _dcp_save_rank(rank: int, source: Path, directory: Path, rendezvous: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=RANKS)
    try:
        mesh = init_device_mesh("cpu", (RANKS,))
        params = json.loads((source / "fsdp_config.json").read_text())["params"]
        local = torch.load(source / f"model_world_size_{RANKS}_rank_{rank}.pt", weights_only=True, mmap=True)
        state = {}
        for name, tensor in local.items():
            shape = torch.Size(params[name]["shape"])
            state[name] = DTensor.from_local(tensor, mesh, [Shard(0)], shape=shape,
                                             stride=torch.empty(shape, device="meta").stride())
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True))
    finally:
        dist.destroy_process_group()


def torch_consolidate(source: str, target: str, config: str, durable: bool = False) -> None:
    """torch's consolidation of the DCP Hugging Face shards in ``source`` into one safetensors file
    (runs in its own process); ``durable``: then fsync it, as trainguard's merge does."""
    from safetensors import safe_open
    # the module is underscored, but this function is what torch's public HuggingFaceStorageWriter calls
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    started = time.perf_counter()
    with safe_open(next(Path(source).glob("*.safetensors")), "pt") as shard:
        names = list(shard.keys())
    Path(target).mkdir()
    consolidate_safetensors_files(source, target, fqn_to_index_mapping=dict.fromkeys(names, 1))
    if durable:
        for path in Path(target).glob("*.safetensors"):
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
    for path in Path(config).iterdir():
        shutil.copy(path, Path(target) / path.name)
    print(f"WORK {time.perf_counter() - started}")


def measure(cmd: list[str], env: dict | None = None) -> tuple[float, float, float]:
    """(seconds, peak RSS in bytes, seconds after imports or NaN) of one child process."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if process.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed: {err.read().decode()[-2000:]}")
        text = out.read().decode()
        work = [float(line.split()[1]) for line in text.splitlines() if line.startswith("WORK ")]
        work += [float(m) for m in re.findall(r"^merged .* in ([0-9.]+) s \(", text, re.MULTILINE)]
    return seconds, usage.ru_maxrss * 1024, work[0] if work else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=1, help="rounds (each runs every merge twice)")
    parser.add_argument("--verl-python", default=os.environ.get("VERL_PYTHON"),
                        help="a Python with verl installed (see the docstring)")
    parser.add_argument("--verl-path", help="a pip --target directory holding verl, put first on PYTHONPATH")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--quick", action="store_true", help="0.25 GiB, one cycle (about two minutes with the DCP setup)")
    parser.add_argument("--naive-worker", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    parser.add_argument("--durable", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--make-checkpoint", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--make-dcp", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    parser.add_argument("--torch-worker", nargs=3, metavar=("SRC", "DST", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_checkpoint:
        print(make_checkpoint(Path(args.make_checkpoint), args.gib))
        return
    if args.make_dcp:
        make_dcp_checkpoint(*map(Path, args.make_dcp))
        return
    if args.torch_worker:
        torch_consolidate(*args.torch_worker, durable=args.durable)
        return
    if args.naive_worker:
        naive_merge(*args.naive_worker, durable=args.durable)
        return
    if args.quick:
        args.gib, args.rounds = 0.25, 1
    work = Path(tempfile.mkdtemp(prefix="tg-merge-bench-", dir=args.dir))
    try:
        source = work / "ckpt"
        # in a child: a forked child's ru_maxrss starts at its parent's resident set, so the parent stays small
        made = subprocess.run([sys.executable, __file__, "--make-checkpoint", str(source), "--gib", str(args.gib)],
                              check=True, capture_output=True, text=True)
        size = int(made.stdout.split()[-1])
        dcp_source = work / "dcp"
        subprocess.run([sys.executable, __file__, "--make-dcp", str(source), str(dcp_source)], check=True)
        config = str(source / "huggingface")
        commands = {
            "trainguard": lambda out: [sys.executable, "-m", "trainguard", "ckpt", "merge", "--backend", "fsdp",
                                       "--local_dir", str(source), "--target_dir", str(out)],
            "naive": lambda out: [sys.executable, __file__, "--naive-worker", str(source), str(out)],
            "naive+fsync": lambda out: [sys.executable, __file__, "--naive-worker", str(source), str(out), "--durable"],
        }
        commands["torch-dcp"] = lambda out: [sys.executable, __file__, "--torch-worker", str(dcp_source), str(out),
                                             config]
        commands["torch-dcp+fsync"] = lambda out: [*commands["torch-dcp"](out), "--durable"]
        verl_env = None
        if args.verl_path:
            args.verl_python = sys.executable
            verl_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [args.verl_path, *filter(None, [os.environ.get("PYTHONPATH")])])}
        if args.verl_python:
            commands["verl"] = lambda out: [args.verl_python, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                                            "--local_dir", str(source), "--target_dir", str(out)]
        order = list(commands) + list(reversed(commands))
        samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in commands}
        for i, name in enumerate(order * args.rounds):
            out = work / f"out-{i}"
            samples[name].append(measure(commands[name](out), verl_env if name == "verl" else None))
            shutil.rmtree(out)
        medians = {name: tuple(median([sample[k] for sample in runs]) for k in range(3))
                   for name, runs in samples.items()}
        (tg_s, tg_rss, tg_work), (nv_s, nv_rss, nv_work) = medians["trainguard"], medians["naive"]
        gb = size / 1e9
        print(f"checkpoint: {size / 2**30:.2f} GiB fp32 in {RANKS} rank files; {2 * args.rounds} runs each, medians")
        print("seconds: the whole process; work: after its imports (python + torch start-up is the same for both)")
        print(f"{'merge':<16}{'seconds':>10}{'work s':>8}{'work GB/s':>11}{'peak RSS GiB':>15}"
              f"{'time vs trainguard':>20}{'RSS vs naive':>14}")
        for name, (s, rss, work) in medians.items():
            print(f"{name:<16}{s:>10.2f}{work:>8.2f}{gb / work:>11.2f}{rss / 2**30:>15.2f}{s / tg_s:>19.2f}x"
                  f"{rss / nv_rss:>13.2f}x")
        if "verl" not in medians:
            print("verl        not run (no --verl-python)")
        speedup, work_speedup, rss_ratio = nv_s / tg_s, nv_work / tg_work, tg_rss / nv_rss
        print(f"speedup {speedup:.2f}x whole process, {work_speedup:.2f}x work (target >= {TARGET_SPEEDUP}x); "
              f"peak RSS ratio {rss_ratio:.2f} (target <= {TARGET_RSS})")
        print("RESULT " + json.dumps({"figure": "merge_throughput_GBps", "trainguard": gb / tg_s, "baseline": gb / nv_s,
                                      "ratio": speedup, "target": f">= {TARGET_SPEEDUP}x naive",
                                      "met": speedup >= TARGET_SPEEDUP}))
        print("RESULT " + json.dumps({"figure": "merge_work_GBps", "trainguard": gb / tg_work, "baseline": gb / nv_work,
                                      "ratio": work_speedup, "target": f">= {TARGET_SPEEDUP}x naive (after imports)",
                                      "met": work_speedup >= TARGET_SPEEDUP}))
        nd_s, nd_work = medians["naive+fsync"][0], medians["naive+fsync"][2]
        print(f"vs naive+fsync (same durability): {nd_s / tg_s:.2f}x whole process, {nd_work / tg_work:.2f}x work")
        print("RESULT " + json.dumps({"figure": "merge_vs_durable_naive_speedup", "trainguard": gb / tg_s,
                                      "baseline": gb / nd_s, "ratio": nd_s / tg_s,
                                      "target": "reported (same durability)", "met": True}))
        if "verl" in medians:
            v_s = medians["verl"][0]
            print("RESULT " + json.dumps({"figure": "merge_vs_verl_speedup", "trainguard": gb / tg_s, "baseline": gb / v_s,
                                          "ratio": v_s / tg_s, "target": "reported (no target)", "met": True}))
        t_s, t_rss = medians["torch-dcp"][0], medians["torch-dcp"][1]
        print("RESULT " + json.dumps({"figure": "merge_vs_torch_dcp_consolidation_speedup", "trainguard": gb / tg_s,
                                      "baseline": gb / t_s, "ratio": t_s / tg_s,
                                      "target": "reported (torch's own tool)", "met": True}))
        print("RESULT " + json.dumps({"figure": "merge_peak_rss_vs_torch_dcp_GiB", "trainguard": tg_rss / 2**30,
                                      "baseline": t_rss / 2**30, "ratio": tg_rss / t_rss,
                                      "target": "reported (torch's own tool)", "met": True}))
        fastest = min((name for name in medians if name != "trainguard"), key=lambda name: medians[name][0])
        f_s = medians[fastest][0]
        print(f"fastest other merge: {fastest}, {f_s:.2f} s; trainguard {tg_s:.2f} s: "
              f"{'as fast or faster' if tg_s <= f_s else 'slower'} ({f_s / tg_s:.2f}x)")
        print("RESULT " + json.dumps({"figure": "merge_vs_fastest_other_speedup", "trainguard": gb / tg_s,
                                      "baseline": gb / f_s, "ratio": f_s / tg_s,
                                      "target": f">= 1.0x the fastest other merge (this run: {fastest})",
                                      "met": tg_s <= f_s}))
        print("RESULT " + json.dumps({"figure": "merge_peak_rss_GiB", "trainguard": tg_rss / 2**30,
                                      "baseline": nv_rss / 2**30, "ratio": rss_ratio,
                                      "target": f"<= {TARGET_RSS} of naive", "met": rss_ratio <= TARGET_RSS}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
