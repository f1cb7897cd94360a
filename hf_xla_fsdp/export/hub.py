"""Export for the Hub: a from_pretrained-ready directory plus a generated model card, optionally pushed.

SOURCE is a sharded FSDP checkpoint (consolidated on the fly, streaming) or a directory that is
already consolidated. The card is rendered from the package's ``templates/model_card.md`` with
huggingface_hub's ``ModelCard``/``ModelCardData``; its numbers come from the checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Union

from ..checkpoint.consolidate import TRAINING_INFO, consolidate, engine_title
from ..checkpoint.layout import check_output, prepare_output, publish
from ..checkpoint.safetensors_io import SafetensorsReader
from ..errors import ConfigError, PushError

__all__ = ["PushError", "count_parameters", "export", "push_folder", "render_card", "template_text"]
_PIPELINES = (("ForCausalLM", "text-generation", "AutoModelForCausalLM"), ("ForMaskedLM", "fill-mask", "AutoModelForMaskedLM"),
              ("ForSequenceClassification", "text-classification", "AutoModelForSequenceClassification"),
              ("ForImageClassification", "image-classification", "AutoModelForImageClassification"),
              ("ForSeq2SeqLM", "text2text-generation", "AutoModelForSeq2SeqLM"))


def template_text() -> str:
    """The model card template shipped inside the package (read as package data, wherever it is installed)."""
    from importlib.resources import files

    return files("hf_xla_fsdp").joinpath("templates", "model_card.md").read_text(encoding="utf-8")


def _is_consolidated(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file())


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    return [directory / "model.safetensors"]


def count_parameters(directory: Path) -> tuple[int, str]:
    """Number of stored elements and their dtype, read from safetensors headers only."""
    total, dtypes = 0, set()
    for path in _safetensors_files(directory):
        reader = SafetensorsReader(path)
        for dtype, shape, _, _ in reader.entries.values():
            total += math.prod(shape)
            dtypes.add(str(dtype).removeprefix("torch."))
    return total, "/".join(sorted(dtypes))


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def render_card(directory: Path, *, model_name: str, license: Optional[str] = None, base_model: Optional[str] = None,
                datasets: Optional[list[str]] = None, load_path: Optional[str] = None) -> Any:
    """The ``ModelCard`` for a consolidated ``directory`` (metadata + body from the training record)."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    config = json.loads((directory / "config.json").read_text())
    info = json.loads((directory / TRAINING_INFO).read_text()) if (directory / TRAINING_INFO).is_file() else {}
    plugin = info.get("plugin") or {}
    metrics = info.get("metrics") or {}
    arch = (config.get("architectures") or ["Model"])[0]
    pipeline_tag, auto_class = next(((p, a) for suffix, p, a in _PIPELINES if arch.endswith(suffix)), (None, "AutoModel"))
    num_params, stored = count_parameters(directory)
    eval_loss = metrics.get("eval_loss")
    dataset = metrics.get("eval_dataset") or (datasets[0] if datasets else None)
    eval_results = None
    if eval_loss is not None and pipeline_tag:
        dataset_id = dataset or "custom"
        eval_results = [
            EvalResult(task_type=pipeline_tag, dataset_type=dataset_id, dataset_name=dataset_id, metric_type="loss",
                       metric_value=round(float(eval_loss), 4), metric_name="eval loss"),
            EvalResult(task_type=pipeline_tag, dataset_type=dataset_id, dataset_name=dataset_id, metric_type="perplexity",
                       metric_value=round(math.exp(float(eval_loss)), 4), metric_name="eval perplexity"),
        ]
    data = ModelCardData(
        library_name="transformers", pipeline_tag=pipeline_tag, license=license, base_model=base_model,
        datasets=datasets, tags=["xla", "fsdp", "tpu", "hf_xla_fsdp", config.get("model_type", "model")],
        model_name=model_name, eval_results=eval_results,
    )
    sharding = plugin.get("sharding")
    has_tokenizer = any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    card = ModelCard.from_template(
        data, template_str=template_text(), model_name=model_name,
        model_type_title=config.get("model_type", "transformers").capitalize(),
        num_parameters=num_params, num_parameters_human=_human(num_params),
        engine=engine_title(info),  # what the rank files recorded
        sharding={"zero3": "ZeRO-3 (nested units per block + root)", "zero2": "ZeRO-2 (root unit only)"}.get(sharding, "unknown"),
        world_size=info.get("world_size", "unknown"), compute_dtype=plugin.get("compute_dtype") or "float32",
        activation_checkpointing="yes" if plugin.get("activation_checkpointing") else ("no" if plugin else "unknown"),
        wrap_classes=", ".join(plugin.get("transformer_layer_cls_to_wrap") or []) or "model's _no_split_modules",
        steps=info.get("step", "unknown"), train_loss=metrics.get("train_loss"), eval_loss=eval_loss,
        perplexity=math.exp(float(eval_loss)) if eval_loss is not None else None, stored_dtype=stored,
        auto_class=auto_class, has_tokenizer=has_tokenizer, load_path=load_path or model_name,
    )
    return card


def write_card(directory: Path, *, model_name: Optional[str] = None, license: Optional[str] = None,
               base_model: Optional[str] = None, datasets: Union[str, list[str], None] = None,
               load_path: Optional[str] = None) -> Path:
    """``README.md`` in the consolidated ``directory`` (a Trainer's ``create_model_card``); one line when it has no
    consolidated model yet. ``model_name`` defaults to the last part of ``load_path`` or of the directory's name."""
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{directory} has no consolidated model yet; call trainer.save_model() first")
    datasets = [datasets] if isinstance(datasets, str) else (list(datasets) if datasets else None)
    name = model_name or (load_path or directory.name).split("/")[-1]
    card = render_card(directory, model_name=name, license=license, base_model=base_model, datasets=datasets,
                       load_path=load_path or str(directory))
    card.save(str(directory / "README.md"))
    return directory / "README.md"


def push_folder(directory: Path, repo_id: str, *, private: bool = False, revision: Optional[str] = None,
                token: Optional[str] = None) -> str:
    """``create_repo`` + ``upload_folder``; raises :class:`PushError` with one clear line on failure."""
    from huggingface_hub import HfApi, get_token

    token = token or get_token()
    if not token:
        raise PushError(f"no Hugging Face token: run `hf auth login` or set HF_TOKEN; {directory} is complete, push it later")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(folder_path=str(directory), repo_id=repo_id, revision=revision,
                                   commit_message="Upload model exported with hf_xla_fsdp")
    except Exception as err:  # network, auth and HTTP errors all end the same way for the user
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PushError(f"pushing to {repo_id} failed ({type(err).__name__}: {first}); "
                        f"{directory} is complete, push it later") from None
    return str(getattr(commit, "commit_url", commit))


def export(
    source: Union[str, os.PathLike],
    output: Union[str, os.PathLike],
    *,
    repo_id: Optional[str] = None,
    push: bool = False,
    private: bool = False,
    revision: Optional[str] = None,
    dtype: str = "auto",
    max_shard_size: Union[int, str] = "5GB",
    overwrite: bool = False,
    ckpt_suffix: Optional[str] = None,
    config: Union[str, os.PathLike, None] = None,
    license: Optional[str] = None,
    base_model: Optional[str] = None,
    datasets: Optional[list[str]] = None,
    token: Optional[str] = None,
    merge_adapters: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Write a Hub-ready ``output`` (weights, config, tokenizer, README.md card) and push it if asked.

    ``source`` (a sharded checkpoint) and ``output`` may be fsspec URLs (``gs://`` with the ``[cloud]`` extra):
    the export is written to a local temporary directory, pushed from there if asked, then uploaded."""
    from ..checkpoint.storage import check_remote_output, is_url, local_path, upload_directory

    if push and not repo_id:
        raise ConfigError("--push needs --repo-id ORG/NAME")
    kwargs = dict(repo_id=repo_id, push=push, private=private, revision=revision, dtype=dtype,
                  max_shard_size=max_shard_size, overwrite=overwrite, ckpt_suffix=ckpt_suffix, config=config,
                  license=license, base_model=base_model, datasets=datasets, token=token,
                  merge_adapters=merge_adapters, progress=progress)
    if not is_url(source):  # a torch_xla prefix stays a string: its trailing slash matters
        source = local_path(source) if ckpt_suffix is None else os.fspath(source).removeprefix("file://")
    if not is_url(output):
        return _export(source, local_path(output), shown=str(local_path(output)), load_path=str(local_path(output)),
                       **kwargs)
    import tempfile

    url = str(output)
    check_remote_output(url, overwrite)  # before the work
    with tempfile.TemporaryDirectory(prefix="hf_xla_fsdp-export-", dir=os.environ.get("HF_XLA_FSDP_SPOOL")) as tmp:
        # transformers cannot load from a bucket URL: the card names the model (pushed, or copied down)
        result = _export(source, Path(tmp) / "out", shown=url, load_path=None, **kwargs)
        upload_directory(Path(tmp) / "out", url, overwrite=overwrite)
    return result


def _export(source: Union[str, Path], output: Path, *, shown: str, load_path: Optional[str], repo_id: Optional[str],
            push: bool, private: bool,
            revision: Optional[str], dtype: str, max_shard_size: Union[int, str], overwrite: bool,
            ckpt_suffix: Optional[str], config: Union[str, os.PathLike, None], license: Optional[str],
            base_model: Optional[str], datasets: Optional[list[str]], token: Optional[str], merge_adapters: bool,
            progress: bool) -> dict[str, Any]:
    """:func:`export` into the local directory ``output``, reported as ``shown``; the card loads ``repo_id``, else
    ``load_path``, else the model's name."""
    model_name = repo_id or shown.rstrip("/").rsplit("/", 1)[-1]
    local_source = isinstance(source, Path)  # a URL is a sharded checkpoint, read by consolidate
    if local_source and (source / "adapter_config.json").is_file() and not (source / "config.json").is_file():
        raise ConfigError(f"{source} holds PEFT adapters, not a model: export the sharded checkpoint with "
                          "--merge-adapters, or push the adapter directory as it is")
    if local_source and _is_consolidated(source):
        if merge_adapters:
            raise ConfigError(f"{source} is already a consolidated model: --merge-adapters needs the sharded checkpoint "
                              "of a PEFT model")
        stage = prepare_output(output, overwrite)
        try:
            for item in source.iterdir():
                if item.is_file() and item.name != "README.md":
                    shutil.copy2(item, stage / item.name)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    else:
        check_output(output, overwrite)  # refuse before consolidating anything
        stage = output.parent / f".{output.name}.export"
        shutil.rmtree(stage, ignore_errors=True)
        from .peft import merged_outputs

        plan_transform = merged_outputs if merge_adapters else None
        consolidate(source, stage, ckpt_suffix=ckpt_suffix, config=config, dtype=dtype,
                    max_shard_size=max_shard_size, progress=progress, plan_transform=plan_transform)
    try:
        card = render_card(stage, model_name=model_name, license=license, base_model=base_model,
                           datasets=datasets, load_path=repo_id or load_path or model_name)
        card.save(str(stage / "README.md"))
        publish(stage, output)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    result = {"output": shown, "model_name": model_name, "pushed": None}
    if push:
        result["pushed"] = push_folder(output, repo_id, private=private, revision=revision, token=token)
    return result
