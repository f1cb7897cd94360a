"""Damaged checkpoint metadata never gives a traceback: seeded random corruptions of every metadata file of one small
real checkpoint (the completion marker, each rank's JSON, a rank file's safetensors header, a side file; and the
shard_metadata inside torch_xla-style ``.pth`` pickles) each end `hf-xla-fsdp consolidate`, `hf-xla-fsdp verify` and
the resume path (``load_checkpoint``) in ONE line naming the damaged file, exit code 2, nothing written.

Two regimes: the checkpoint as this version saves it (digests in the marker catch every change) and the same
checkpoint with every digest stripped, as earlier versions wrote it, where the schema checks alone must catch the
corruptions they can see (renamed keys, missing entries, wrong types, negative or impossible sizes, extra ranks,
truncations) in the structures every reader consumes.
"""

from __future__ import annotations

import copy
import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, build_ranks, fake_adam_state, save_torch_xla_style, tiny_llama, xla_env

from hf_xla_fsdp.checkpoint import COMPLETE_MARKER, commit_checkpoint, load_checkpoint, write_rank_file
from hf_xla_fsdp.checkpoint.layout import read_marker, with_side_digests
from hf_xla_fsdp.checkpoint.schema import marker_bytes
from hf_xla_fsdp.cli import main
from hf_xla_fsdp.errors import CheckpointError

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)

WORLD = 2
SEED = 27
CONFIG = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64)
RANK_JSON = [f"rank-{r:05d}-of-{WORLD:05d}.json" for r in range(WORLD)]
SIDE = "tokenizer_config.json"


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One real 2-rank FSDP v1 checkpoint (AdamW state, scheduler, a side file), a copy with every digest stripped,
    torch_xla-style .pth files of the same ranks, and the models a resume loads into."""
    root = tmp_path_factory.mktemp("fuzz")
    models = build_ranks(tiny_llama(**CONFIG), WORLD)
    opts = fake_adam_state(models)
    base = root / "sealed"
    for model, opt in zip(models, opts):
        write_rank_file(base, model, opt, scheduler(opt), step=3)
    commit_checkpoint(base, WORLD)
    (base / SIDE).write_text(json.dumps({"model_max_length": 64}))
    (base / COMPLETE_MARKER).write_bytes(marker_bytes(with_side_digests(read_marker(base), base)))

    legacy = root / "legacy"  # as an earlier version wrote it: no digest anywhere, schema only
    shutil.copytree(base, legacy)
    marker = json.loads((legacy / COMPLETE_MARKER).read_text())
    for key in ("self_sha256", "side_files"):
        marker.pop(key)
    for entry in marker["files"].values():
        entry.pop("meta_sha256"), entry.pop("checksums")
    (legacy / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1))
    for name in RANK_JSON:
        meta = json.loads((legacy / name).read_text())
        meta.pop("header_sha256")
        (legacy / name).write_text(json.dumps(meta, indent=1))

    pth = root / "pth"
    pth.mkdir()
    save_torch_xla_style(str(pth / "model"), models)
    config_dir = root / "config"
    tiny_llama(**CONFIG).save_pretrained(config_dir)

    targets = []
    for model in build_ranks(tiny_llama(**CONFIG), WORLD, seed=11):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        targets.append((model, opt, scheduler(opt)))
    return SimpleNamespace(sealed=base, legacy=legacy, pth=pth, config=config_dir, targets=targets)


# --------------------------------------------------------------------------- corruptions
def nodes(obj, path=()):
    """Every (path, value) of a JSON-like tree; long lists (RNG words) contribute their first three and last items."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from nodes(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        picked = range(len(obj)) if len(obj) <= 4 else [0, 1, 2, len(obj) - 1]
        for i in picked:
            yield from nodes(obj[i], path + (i,))


def text(path) -> str:
    return "/".join(f"#{p}" if isinstance(p, int) else str(p) for p in path)


def parent(obj, path):
    for p in path[:-1]:
        obj = obj[p]
    return obj


def damaged_key(rng: random.Random, key: str) -> str:
    if not key:
        return "x"
    i = rng.randrange(len(key))
    return key[:i] + rng.choice([c for c in "XqZ7_" if c != key[i]]) + key[i + 1:]


def other_type(value):
    """A value of another JSON type (None becomes a list: a string or a number may be a legal value there)."""
    if isinstance(value, bool):
        return "true"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return 7
    if isinstance(value, (list, tuple)):
        return {"x": 1}
    if isinstance(value, dict):
        return [1]
    return [1]


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def apply(rng: random.Random, obj, kind: str, path):
    """``obj`` with the corruption ``kind`` at ``path`` (a deep copy); returns (new object, description)."""
    obj = copy.deepcopy(obj)
    holder, last = parent(obj, path), path[-1]
    value = holder[last]
    if kind == "rename":
        new = damaged_key(rng, last)
        holder[new] = holder.pop(last)
        return obj, f"key {text(path)} renamed {new!r}"
    if kind == "delete":
        del holder[last]
        return obj, f"{text(path)} deleted"
    if kind == "type":
        holder[last] = other_type(value)
    elif kind == "negative":
        holder[last] = -1 - value
    elif kind == "huge":
        holder[last] = value + (1 << 33)
    elif kind == "bump":
        holder[last] = value + 1 if is_int(value) else value * 2 + 1
    elif kind == "flip":
        holder[last] = damaged_key(rng, value)
    return obj, f"{text(path)}: {kind} -> {_short(holder[last])}"


def _short(v) -> str:
    s = repr(v)
    return s if len(s) < 40 else s[:37] + "..."


def applicable(kind: str, path, value, holder) -> bool:
    if not path:
        return False
    last = path[-1]
    if kind == "rename":
        return isinstance(holder, dict) and isinstance(last, str)
    if kind == "delete":
        return True
    if kind == "type":
        return True
    if kind in ("negative", "huge", "bump"):
        return is_int(value) if kind != "bump" else isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "flip":
        return isinstance(value, str) and len(value) > 0
    return False


# what an earlier version's checkpoint (no digests) must still refuse: schema-visible damage of the structures every
# reader consumes (free-form parts, e.g. the model config's values or the scheduler's, are checked by resume against
# the live objects: see the targeted tests below)
_META_RULES = {
    "rename": [r"[^/]+", r"shard_metadata/[^/]+", r"shard_metadata/shard_info/[^/]*", r"shard_metadata/shard_info/[^/]*/[^/]+",
               r"shard_metadata/shard_info/[^/]*/[^/]+/_orig_(size|name)", r"checksums/[^/]+", r"checksums/tensors/[^/]+",
               r"optimizer/[^/]+", r"optimizer/param_groups/#\d+/params", r"rng/[^/]+", r"model_config/model_type"],
    "delete": [r"format|rank|world_size|shard_metadata", r"shard_metadata/(shard_info|flatten_info|world_size|rank)",
               r"shard_metadata/shard_info/[^/]*(/[^/]+)?", r"shard_metadata/shard_info/[^/]*/[^/]+/_orig_(size|name)",
               r"checksums/(algorithm|tensors)", r"checksums/tensors/[^/]+", r"optimizer/(param_groups|param_names)",
               r"optimizer/param_groups/#\d+/params(/#\d+)?", r"optimizer/param_names/#\d+/#\d+", r"rng/(python|numpy)/#\d+",
               r"model_config/model_type"],
    "type": [r"format|file_id|rank|world_size|run_id|step|tensor_file_bytes|shard_metadata|checksums|optimizer|scheduler"
             r"|rng|model_config|plugin|extra", r"shard_metadata/.*", r"checksums/.*", r"optimizer/param_groups(/#\d+)?",
             r"optimizer/param_groups/#\d+/params(/.*)?", r"optimizer/param_names(/.*)?", r"rng/.*",
             r"model_config/model_type"],
    "negative": [r"rank|world_size|step|tensor_file_bytes", r"shard_metadata/.*", r"optimizer/param_groups/#\d+/params/.*",
                 r"rng/.*"],
    "huge": [r"rank|world_size|tensor_file_bytes", r"shard_metadata/(rank|world_size)",
             r"shard_metadata/shard_info/.*/_orig_size/#\d+", r"optimizer/param_groups/#\d+/params/.*",
             r"rng/(python|numpy)/.*"],  # the XLA seed is any 64-bit number
}
_MARKER_RULES = {
    "rename": [r"[^/]+", r"files/[^/]+", r"files/[^/]+/[^/]+"],
    "delete": [r"world_size|files", r"files/[^/]+", r"files/[^/]+/file_id"],
    "type": [r".*"],
    "negative": [r".*"],
    "huge": [r"world_size|files/[^/]+/bytes"],
}


def eligible(rules, kind, path) -> bool:
    return any(re.fullmatch(rule, text(path)) for rule in rules.get(kind, ()))


def pick(rng: random.Random, paths):
    """A path, each area (first two levels: ``shard_metadata/shard_info``, ``rng/python``, ...) equally likely, so the
    hundreds of shard_info entries do not drown the rest."""
    areas: dict = {}
    for p in paths:
        areas.setdefault(p[:2], []).append(p)
    return rng.choice(areas[rng.choice(sorted(areas, key=text))])


def json_cases(made, regime: str, count: int, seed: int):
    """Materialised corruptions: (name, description, {file name: new bytes})."""
    rng = random.Random(seed)
    src = getattr(made, regime)
    docs = {name: json.loads((src / name).read_text()) for name in [COMPLETE_MARKER, *RANK_JSON]}
    kinds = ["rename", "delete", "type", "negative", "huge", "extra-rank", "truncate"]
    if regime == "sealed":
        kinds += ["bump", "flip"]
    cases = []
    while len(cases) < count:
        name, kind = rng.choice(list(docs)), rng.choice(kinds)
        doc, raw = docs[name], (src / name).read_bytes()
        if kind == "truncate":
            cut = rng.randrange(1, len(raw) - 1)
            cases.append((name, f"truncated at byte {cut} of {len(raw)}", raw[:cut]))
            continue
        if kind == "extra-rank":
            doc = copy.deepcopy(doc)
            if name == COMPLETE_MARKER:
                entry = dict(next(iter(doc["files"].values())))
                doc["files"][f"rank-{WORLD:05d}-of-{WORLD:05d}.safetensors"] = entry
                what = "an extra rank listed"
            else:
                doc["rank"] = doc["world_size"] = WORLD + 1
                doc["shard_metadata"]["rank"] = doc["shard_metadata"]["world_size"] = WORLD + 1
                what = "rank/world_size say an extra rank"
            cases.append((name, what, json.dumps(doc, indent=1).encode()))
            continue
        rules = _MARKER_RULES if name == COMPLETE_MARKER else _META_RULES
        candidates = [p for p, v in nodes(doc)
                      if applicable(kind, p, v, parent(doc, p) if p else None)
                      and (regime == "sealed" and p != ("self_sha256",) or eligible(rules, kind, p))]
        if not candidates:
            continue
        new, what = apply(rng, doc, kind, pick(rng, candidates))
        cases.append((name, what, json.dumps(new, indent=1).encode()))
    return cases


def raw_cases(made, count: int, seed: int):
    """Byte flips in the files whose raw bytes are digested (rank JSON, a safetensors header, a side file)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        name = rng.choice([*RANK_JSON, "rank-00001-of-00002.safetensors", SIDE])
        raw = bytearray((made.sealed / name).read_bytes())
        end = 8 + int.from_bytes(raw[:8], "little") if name.endswith(".safetensors") else len(raw)
        pos = rng.randrange(8 if name.endswith(".safetensors") else 0, end)
        raw[pos] ^= 1 << rng.randrange(8)
        cases.append((name, f"bit flipped at byte {pos}", bytes(raw)))
    return cases


# --------------------------------------------------------------------------- the three readers
def stem(name: str) -> str:
    return name if name in (COMPLETE_MARKER, SIDE) else name.split(".")[0]


def assert_cli_refuses(capsys, argv, where: Path, named: str, what: str):
    before = sorted(p.name for p in where.iterdir())
    rc = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2, (what, argv[0], rc, captured.out[-300:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, (what, err)
    assert err.startswith(f"hf-xla-fsdp {argv[0]}: error: ") and named in err, (what, err)
    assert sorted(p.name for p in where.iterdir()) == before, what  # nothing written, no staging leftovers


def check_everything_refuses(made, capsys, case_dir: Path, name: str, what: str):
    named = stem(name)
    out = case_dir.parent / "out"
    assert_cli_refuses(capsys, ["consolidate", str(case_dir), "--output", str(out), "--quiet"], case_dir.parent,
                       named, what)
    assert_cli_refuses(capsys, ["verify", str(case_dir)], case_dir.parent, named, what)
    # a resume of every rank: the rank whose file is damaged (any rank, for the marker) stops with one line; a rank
    # that reads only intact files may load them (its process would be stopped with the job)
    ranks = [int(name[5:10])] if name.startswith("rank-") else range(WORLD)
    messages = []
    for rank in ranks:
        model, opt, sched = made.targets[rank]
        try:
            load_checkpoint(case_dir, model, opt, sched)
        except CheckpointError as err:
            messages.append(str(err))
    assert messages, f"{what}: every rank resumed"
    assert all(len(m.splitlines()) == 1 and named in m for m in messages), (what, messages)


def run_case(made, capsys, tmp_path, regime, name, what, data):
    case_dir = tmp_path / "case" / "ckpt"
    if case_dir.parent.exists():
        shutil.rmtree(case_dir.parent)
    case_dir.parent.mkdir(parents=True)
    shutil.copytree(getattr(made, regime), case_dir)
    (case_dir / name).write_bytes(data)
    check_everything_refuses(made, capsys, case_dir, name, f"{regime} {name}: {what}")


# --------------------------------------------------------------------------- tests
def test_undamaged_checkpoints_are_read(made, capsys, tmp_path):
    """The baseline of the fuzz: both regimes consolidate, verify and resume."""
    for regime in ("sealed", "legacy"):
        src = getattr(made, regime)
        assert main(["consolidate", str(src), "--output", str(tmp_path / regime), "--quiet"]) == 0
        assert main(["verify", str(src)]) == 0
        for model, opt, sched in made.targets:
            assert load_checkpoint(src, model, opt, sched)["step"] == 3
    capsys.readouterr()
    assert (tmp_path / "sealed" / SIDE).is_file()


def test_renamed_orig_size_key(made, capsys, tmp_path):
    """The reported case: `_orig_size` -> `_orig_sizX` (JSON still valid) in a rank file's metadata."""
    for regime in ("sealed", "legacy"):
        raw = (getattr(made, regime) / RANK_JSON[1]).read_text()
        assert raw.count('"_orig_size"') > 1
        data = raw.replace('"_orig_size"', '"_orig_sizX"', 1).encode()
        run_case(made, capsys, tmp_path, regime, RANK_JSON[1], "_orig_size renamed _orig_sizX", data)
    case_dir = tmp_path / "case" / "ckpt"  # the legacy case: the schema names the entry
    rc = main(["verify", str(case_dir)])
    err = capsys.readouterr().err
    assert rc == 2 and "has an entry '_orig_sizX' where '_orig_size' belongs" in err, err


@pytest.mark.parametrize("regime,count", [("sealed", 20), ("legacy", 24)])
def test_random_json_corruptions(made, capsys, tmp_path, regime, count):
    for name, what, data in json_cases(made, regime, count, seed=SEED + len(regime)):
        run_case(made, capsys, tmp_path, regime, name, what, data)


def test_random_byte_flips_in_digested_files(made, capsys, tmp_path):
    for name, what, data in raw_cases(made, 8, seed=SEED):
        run_case(made, capsys, tmp_path, "sealed", name, what, data)


def test_resume_checks_scheduler_and_optimizer_groups_against_the_live_objects(made, tmp_path):
    """Free-form state only a resume consumes (no digest in an old checkpoint): a renamed scheduler key or a
    learning rate turned into a string is one line at load, not an error at the next step."""
    for mutate, needle in [(lambda m: m["scheduler"].__setitem__("last_epocX", m["scheduler"].pop("last_epoch")),
                            "lacks the entry 'last_epoch'"),
                           (lambda m: m["optimizer"]["param_groups"][0].__setitem__("lr", "0.001"),
                            "param_groups[0]['lr'] must be a number")]:
        case = tmp_path / "ckpt"
        shutil.rmtree(case, ignore_errors=True)
        shutil.copytree(made.legacy, case)
        meta = json.loads((case / RANK_JSON[0]).read_text())
        mutate(meta)
        (case / RANK_JSON[0]).write_text(json.dumps(meta))
        model, opt, sched = made.targets[0]
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(case, model, opt, sched)
        message = str(err.value)
        assert needle in message and RANK_JSON[0] in message and len(message.splitlines()) == 1, message


# --------------------------------------------------------------------------- torch_xla's .pth (no marker)
def pth_cases(made, count: int, seed: int):
    rng = random.Random(seed)
    path = sorted(made.pth.glob("*.pth"))[1]
    ckpt = torch.load(path, weights_only=True)
    md = json.loads(json.dumps(ckpt["shard_metadata"], default=lambda o: str(o).removeprefix("torch.")))
    cases = []
    while len(cases) < count:
        kind = rng.choice(["rename", "delete", "type", "negative", "huge"])
        candidates = [p for p, v in nodes(md) if applicable(kind, p, v, parent(md, p) if p else None)
                      and eligible(_META_RULES, kind, ("shard_metadata", *p))]
        if not candidates:
            continue
        new, what = apply(rng, md, kind, pick(rng, candidates))
        if isinstance(new.get("buffer_info"), dict):  # dtypes back as torch.dtype, as torch_xla pickles them
            for info in new["buffer_info"].values():
                if isinstance(info, dict) and isinstance(info.get("_orig_dtype"), str):
                    info["_orig_dtype"] = getattr(torch, info["_orig_dtype"], info["_orig_dtype"])
        cases.append((path.name, f"shard_metadata {what}", {**ckpt, "shard_metadata": new}))
    return cases


def test_random_shard_metadata_corruptions_in_torch_xla_pth(made, capsys, tmp_path):
    """torch_xla's own rank files carry no digest: the schema of their pickled shard_metadata protects them."""
    for name, what, obj in pth_cases(made, 10, seed=SEED):
        case = tmp_path / "case"
        shutil.rmtree(case, ignore_errors=True)
        shutil.copytree(made.pth, case)
        torch.save(obj, case / name)
        prefix = f"{case}/model"
        assert_cli_refuses(capsys, ["consolidate", "--ckpt-prefix", prefix, "--ckpt-suffix", "_rank-*.pth",
                                    "--config", str(made.config), "--output", str(tmp_path / "out"), "--quiet"],
                           tmp_path, name, what)
        assert_cli_refuses(capsys, ["verify", "--ckpt-prefix", prefix, "--ckpt-suffix", "_rank-*.pth"], tmp_path,
                           name, what)


# --------------------------------------------------------------------------- as users run it
def test_console_script_on_corrupted_metadata(made, tmp_path):
    """Two real processes of the console script: the renamed key, one line on stderr, exit code 2, no output."""
    case = tmp_path / "ckpt"
    shutil.copytree(made.legacy, case)
    raw = (case / RANK_JSON[0]).read_text()
    (case / RANK_JSON[0]).write_text(raw.replace('"_orig_size"', '"_orig_sizX"', 1))
    script = Path(sys.executable).with_name("hf-xla-fsdp")
    for argv in (["consolidate", str(case), "--output", str(tmp_path / "out"), "--quiet"], ["verify", str(case)]):
        proc = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, cwd=ROOT,
                              env=xla_env(), timeout=300)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert RANK_JSON[0] in lines[0] and "_orig_sizX" in lines[0], lines
    assert not (tmp_path / "out").exists()
