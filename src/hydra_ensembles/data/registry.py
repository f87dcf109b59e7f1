"""Naming data on the command line: registered data sources by name, users' files by path.

Named sources: whatever `register_data_source` added (the applications register the paper's
offline data sets, `hydra_experiments.datasets`: ``bbc-news[:train|val|test]``, ``mnist``, ...;
every ``hydra-ens`` command has them). Files: ``.csv``/``.tsv``/``.jsonl`` (text), ``.npz`` (images),
or a directory of ``<class>/<image>`` files. Hugging Face datasets (`data.hf`): a
``save_to_disk`` folder (``FOLDER[:SPLIT]``), a ``.parquet``/``.arrow`` file, or
``hf:ID[@CONFIG][:SPLIT]`` for a hub dataset in the local cache. A named source is one
registration (`register_data_source`: its loader and its parts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import InputError
from .hf import ARROW_SUFFIXES, is_saved_dataset, load_hf
from .images import ImageDataset, image_batches, load_image_folder, load_npz
from .text import TextDataset, batches, load_text_table

Dataset = TextDataset | ImageDataset
DATA_SOURCES: dict[str, tuple[Callable[[str], Dataset], tuple[str, ...]]] = {}
"""Named datasets: name -> (loader of a part, its parts: the first is the default; none: the
name alone). `register_data_source` adds one."""


def register_data_source(name: str, load: Callable[[str], Dataset], parts: tuple[str, ...] = ()) -> None:
    """Let every command read ``name`` (``name:PART`` for one of ``parts``) as ``load(part)``
    gives it (``part`` is ``""`` for a source without parts)."""
    if not name or ":" in name:
        raise InputError(f"a data source needs a name without ':', got {name!r}")
    DATA_SOURCES[name] = (load, tuple(parts))


def _from_source(name: str, part: str) -> Dataset:
    """The dataset a registered source gives for ``part`` (its default where empty); InputError
    for a part it does not have."""
    load, parts = DATA_SOURCES[name]
    if not parts:
        if part:
            raise InputError(f"{name} has no parts: write {name}, not {name}:{part}")
        return load("")
    if (part or parts[0]) not in parts:
        raise InputError(f"{name} has parts {sorted(parts)}, not {part!r}")
    return load(part or parts[0])


def load_spec(
    spec: str, text_column: str | None = None, label_column: str | None = None, labelled: bool = True
) -> TextDataset | ImageDataset:
    """The dataset a command-line spec names (see the module docstring). Columns: a named one must
    exist; unnamed, tables read ``text`` and ``label`` and Hugging Face datasets guess from their
    features. ``labelled=False``: the labels are not read (OOD data)."""
    if spec.startswith("hf:"):
        source, _, split = spec[3:].rpartition(":") if ":" in spec[3:] else (spec[3:], "", "")
        return load_hf(source, split or None, text_column, label_column, labelled)
    folder, _, split = spec.rpartition(":")
    if folder and is_saved_dataset(Path(folder)):
        return load_hf(folder, split, text_column, label_column, labelled)
    name, _, part = spec.partition(":")
    if name in DATA_SOURCES and Path(spec).exists():
        raise InputError(
            f"{spec!r} names both a registered data source and a path here: write ./{spec} for the "
            "path (or run from another folder for the named data)"
        )
    if name in DATA_SOURCES:
        return _from_source(name, part)
    path = Path(spec)
    if is_saved_dataset(path) or path.suffix in ARROW_SUFFIXES:
        return load_hf(spec, None, text_column, label_column, labelled)
    if path.is_dir():
        return load_image_folder(path)
    if path.suffix in (".npz", ".csv", ".tsv", ".jsonl", ".json") and not path.is_file():
        raise InputError(f"data file {spec!r} does not exist")
    if path.suffix == ".npz":
        return load_npz(path)
    if path.suffix in (".csv", ".tsv", ".jsonl", ".json"):
        return load_text_table(path, text_column or "text", (label_column or "label") if labelled else None)
    raise InputError(
        f"unknown data {spec!r}: use one of {list(DATA_SOURCES)}, a .csv/.tsv/.jsonl/.npz/.parquet file, an "
        "image folder, a Hugging Face save_to_disk folder, or hf:ID[@CONFIG][:SPLIT]"
    )


def to_batches(
    dataset: TextDataset | ImageDataset,
    preprocessor: Any = None,
    batch_size: int = 32,
    max_length: int = 128,
) -> Iterator[dict]:
    """Model-input batches (with labels) of a text or image dataset. ``preprocessor``: the
    model's tokenizer (text, required) or image processor (images; without one, pixels are only
    normalised to [-1, 1], as for the models trained here)."""
    if isinstance(dataset, ImageDataset):
        return image_batches(dataset, batch_size, processor=preprocessor)
    if preprocessor is None:
        raise InputError("text data needs the model's tokenizer")
    return batches(dataset, preprocessor, batch_size, max_length)


def position_limit(tokenizer: Any, models: Any) -> int | None:
    """The most tokens the tokenizer and every model (or ensemble: its configuration) know
    positions for, or None where none says."""
    limits = [getattr(tokenizer, "model_max_length", None)]
    for m in models if isinstance(models, list) else [models]:
        config = getattr(m, "config", None)
        limits.append(getattr(config, "max_position_embeddings", None) if config is not None else None)
    known = [int(n) for n in limits if isinstance(n, int) and 0 < n < 1_000_000]
    return min(known) if known else None


def saved_length(models) -> int | None:
    """The token length the model(s) were trained and calibrated at (their metadata's
    ``max_length``); InputError where models of one command say different lengths."""
    from ..adapters import model_configs
    from ..saving.metadata import read_metadata

    lengths = {read_metadata(c).max_length for c in model_configs(models)} - {None}
    if len(lengths) > 1:
        raise InputError(
            f"the models were fit at different token lengths {sorted(lengths)}: give --max-length"
        )
    return int(lengths.pop()) if lengths else None


def check_max_length(max_length: int, tokenizer: Any, models: Any) -> None:
    """Refuse a ``max_length`` beyond the positions the tokenizer and the model(s) know (longer
    inputs would index past the position embeddings)."""
    limit = position_limit(tokenizer, models)
    if limit is not None and max_length > limit:
        raise InputError(f"--max-length {max_length} exceeds the model's {limit} positions")


def align_padding(tokenizer: Any, models: Any) -> None:
    """Make the tokenizer pad with the id a decoder classifier's pooling looks for: such a model
    reads the last token that is not ``config.pad_token_id``, so padding with any other id would
    have it read padding. A tokenizer without a padding token pads with the model's, or else with
    its end-of-sequence token (and a model without one is given the tokenizer's); a tokenizer and
    a model that name different ids are refused. Other models are left as they are."""
    from ..adapters import last_token_configs

    decoders = last_token_configs(models)
    if not decoders or tokenizer is None:
        return
    named = {c.pad_token_id for c in decoders if c.pad_token_id is not None}
    if len(named) > 1:
        raise InputError(f"the models pad with different token ids {sorted(named)}")
    if tokenizer.pad_token_id is None:
        pad = named.pop() if named else tokenizer.eos_token_id
        if pad is None:
            raise InputError(
                "the tokenizer has no padding or end-of-sequence token, and the model names no "
                "pad_token_id: its last-token pooling cannot find the end of a padded input"
            )
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(pad))
    elif named and named != {tokenizer.pad_token_id}:
        raise InputError(
            f"the tokenizer pads with token id {tokenizer.pad_token_id} but the model's "
            f"config.pad_token_id is {named.pop()}: its last-token pooling would read padding "
            "(use the tokenizer the model was trained with)"
        )
    for config in decoders:
        config.pad_token_id = tokenizer.pad_token_id


def model_batches(
    dataset: TextDataset | ImageDataset,
    model: Any,
    preprocessor: Any = None,
    batch_size: int = 32,
    max_length: int = 128,
    labelled: bool = True,
    name: str = "the data",
) -> tuple[TextDataset | ImageDataset, list[dict]]:
    """``dataset`` checked against ``model`` (a model or a list of them: texts for a text model,
    images for a vision one), its labels numbered as the model's classes
    (`labels.align_labels`), as model-input batches (with ``labels`` when ``labelled``).
    Returns the aligned dataset and its batches; ``name`` names the data in errors."""
    from ..batching import model_inputs
    from ..models import takes_images
    from .labels import align_labels, model_class_names, num_model_labels

    if labelled and not dataset.classes:
        raise InputError(f"{name} has no labels; this option needs labelled data")
    first = model[0] if isinstance(model, list) else model
    vision, images = takes_images(first), isinstance(dataset, ImageDataset)
    if vision != images:
        kind = "images" if images else "texts"
        raise InputError(f"{name} holds {kind}, but the model takes {'images' if vision else 'text'}")
    if labelled:
        dataset = align_labels(dataset, model_class_names(model), num_model_labels(model), name)
    if not images:
        if preprocessor is None:
            raise InputError(
                "text data needs a tokenizer and none was found with the model; pass --tokenizer MODEL "
                "where the command takes it (build and finetune save the tokenizer with the model; a "
                "model saved from Python keeps one only where it was saved beside it)"
            )
        check_max_length(max_length, preprocessor, model)
        align_padding(preprocessor, model)
    out = list(to_batches(dataset, preprocessor, batch_size, max_length))
    return dataset, out if labelled else [model_inputs(b) for b in out]
