"""Every ``fp4train`` command of the examples the README shows (``examples/``) runs as written, in a fresh folder
laid out as a clone beside ``shared/``: the same subcommands, flags, paths and data layout, with only the sizes
shrunk (the tiny model, a few steps, two seeds) and, on a machine without GPUs, ``--gpus`` left out. The data
folders the commands name are made small, in their real layout (enwiki's ``train-*``/``val-*`` xz JSON-lines shards, tiny-shakespeare's ``input.txt``)."""

import json
import lzma
import sys
from pathlib import Path

import pytest
import torch
from examples_files import commands

from fp4train.cli import main

#: the examples the README shows, whose commands read ``../shared/data`` as a clone beside ``shared/`` does
README_EXAMPLES = ("quickstart.sh", "training.sh", "several_gpus.sh")

#: flag -> the value a command takes here (the sizes); None: the flag and its value are left out
SHRUNK = {"--model": "tiny", "--max-steps": "2", "--seq-len": "32", "--batch-size": "2", "--warmup-steps": "1",
          "--eval-every": "2", "--eval-batches": "1", "--steps": "2", "--capture-every": "1", "--seeds": "0,1",
          "--gpus": None}
#: AdaHOP calibrates over its first 20 steps: its runs take 2 FP4 steps after them
CALIBRATING = {"--max-steps": "22"}


def readme_commands() -> list[list[str]]:
    """The argument lists of the README's examples' ``fp4train ...`` and ``torchrun ... -m fp4train ...`` commands,
    in order."""
    return commands(*README_EXAMPLES)


#: the sizes a command that trains takes where it leaves them to their defaults
TRAINING = ("--max-steps", "--seq-len", "--batch-size", "--warmup-steps", "--eval-every", "--eval-batches")


def shrink(argv: list[str]) -> list[str]:
    """``argv`` with :data:`SHRUNK`'s sizes (and :data:`CALIBRATING`'s for an AdaHOP recipe), given also where the
    command leaves them to their defaults (a ``train``/``compare`` that starts a run, ``analyze``)."""
    sizes = {**SHRUNK, **(CALIBRATING if "adahop" in " ".join(argv) else {})}
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in sizes and i + 1 < len(argv):
            if sizes[a] is not None:
                out += [a, sizes[a]]
            i += 2
            continue
        out.append(a)
        i += 1
    command = next((a for a in out if a in ("train", "compare", "analyze")), None)
    wanted = {"train": TRAINING, "compare": TRAINING, "analyze": ("--steps", "--seq-len", "--batch-size")}.get(command, ())
    if "--resume" not in out:
        out += [x for f in wanted if f not in out for x in (f, sizes[f])]
    return out


def _lay_out(root: Path) -> Path:
    """``root/shared/data`` as the README's commands read it, and ``root/work`` (the clone's folder) to run in."""
    data = root / "shared" / "data"
    text = (Path(__file__).resolve().parent.parent / "fp4train" / "data" / "assets" / "tinyshakespeare.txt.xz")
    plays = lzma.decompress(text.read_bytes()).decode()
    docs = [d for d in plays.split("\n\n") if d.strip()]
    (data / "enwiki").mkdir(parents=True)
    for name, part in (("train-00", docs[:3000]), ("train-01", docs[3000:6000]), ("val-00", docs[6000:6600])):
        lines = "".join(json.dumps({"id": i, "title": f"t{i}", "text": t}) + "\n" for i, t in enumerate(part))
        (data / "enwiki" / f"{name}.jsonl.xz").write_bytes(lzma.compress(lines.encode()))
    (data / "tinyshakespeare").mkdir()
    (data / "tinyshakespeare" / "input.txt").write_text(plays[:6000])
    work = root / "work"
    (work / "my-mixtral").mkdir(parents=True)
    (work / "my-mixtral" / "config.json").write_text(json.dumps(
        {"model_type": "mixtral", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
         "max_position_embeddings": 128}))
    return work


def _single_process(argv: list[str]) -> bool:
    return argv[0] == "fp4train" and "--parallel" not in argv


def test_the_readme_has_commands_of_every_kind():
    kinds = {a[1] for a in readme_commands() if a[0] == "fp4train"}
    assert {"compare", "train", "eval", "export", "generate", "analyze", "recipes"} <= kinds


def _run_all(tmp_path, monkeypatch, capsys, pick) -> int:
    work = _lay_out(tmp_path)
    monkeypatch.chdir(work)
    monkeypatch.setenv("FP4TRAIN_CACHE", str(tmp_path / "cache"))
    ran = 0
    for argv in readme_commands():
        if not pick(argv):
            continue
        args = shrink(argv)
        if args[0] == "torchrun":
            import subprocess

            at = args.index("-m")
            cmd = [sys.executable, "-m", "torch.distributed.run", *args[1:at], "-m", "fp4train", *args[at + 2:]]
            r = subprocess.run(cmd + ["--device", "cpu", "--no-progress"], capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, (argv, r.stderr[-2000:])
        elif "--parallel" in args and "--gpus" in argv and not torch.cuda.is_available():
            # a comparison whose runs each spread over GPUs: on a machine without them, refused in one line
            rc = main(args[1:])
            err = capsys.readouterr().err
            assert rc == 2 and "--gpus" in err and len(err.strip().splitlines()) == 1, (" ".join(argv), err[-2000:])
        else:
            rc = main(args[1:])
            err = capsys.readouterr().err
            assert rc == 0, (" ".join(argv), err[-2000:])
        ran += 1
    return ran


def test_every_single_process_readme_command_runs_as_written(tmp_path, monkeypatch, capsys):
    """In order, so that eval/export/generate read the runs the training commands made; ``export --out hf/...`` makes
    its ``hf`` folder."""
    ran = _run_all(tmp_path, monkeypatch, capsys, _single_process)
    assert ran >= 10
    assert (tmp_path / "work" / "hf" / "60m-tib2d" / "model.safetensors").is_file()
    assert (tmp_path / "work" / "runs" / "cmp" / "report.md").is_file()


@pytest.mark.slow
def test_every_multi_process_readme_command_runs_as_written(tmp_path, monkeypatch, capsys):
    """The ``torchrun`` and ``--parallel`` commands, two processes on the CPU (gloo); a comparison spread over GPUs
    (``compare --parallel ddp --gpus 0,1``) is refused in one line on a machine without them."""
    assert _run_all(tmp_path, monkeypatch, capsys, lambda a: not _single_process(a)) >= 3
