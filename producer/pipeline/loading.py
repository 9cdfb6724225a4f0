"""Finding a pipeline by reference and building it (``stoker produce --pipeline REF --pipeline-arg K=V``): a
built-in by name (found lazily in ``producer/images/``, which imports the interface), ``package.module:attr`` or
``path/file.py:attr``; ``--pipeline-arg`` strings are converted to the factory's parameter types. Every failure is a
PipelineError saying what went wrong and how to fix it (the daemon refuses to start with it).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from stoker.producer.pipeline.interface import Pipeline, PipelineError

BUILTIN = ("imagenet", "detection", "segmentation", "image_text")


def _builtin(name: str) -> Callable[..., Pipeline]:
    if name == "image_text":  # its own module: builtin_pipelines holds the image-only ones
        from stoker.producer.images import image_text

        return image_text.make_image_text
    from stoker.producer.images import builtin_pipelines

    return getattr(builtin_pipelines, f"make_{name}")


def resolve(ref: str) -> Callable[..., Pipeline] | Pipeline:
    """The factory (or Pipeline) ``ref`` names: a built-in, ``package.module:attr`` or ``path/file.py:attr``."""
    if ref in BUILTIN:
        return _builtin(ref)
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise PipelineError(f"--pipeline {ref!r}: expected one of {', '.join(BUILTIN)}, "
                            "package.module:function or path/to/file.py:function")
    found = import_reference(ref, "--pipeline")
    if not isinstance(found, Pipeline) and not callable(found):
        raise PipelineError(f"--pipeline {ref!r}: {attr} is a {type(found).__name__}, not a Pipeline or a function "
                            "returning one")
    return found


def import_reference(ref: str, flag: str) -> Any:
    """The attribute ``ref`` names, ``package.module:attr`` or ``path/file.py:attr`` (a pipeline, a tokenizer).

    PipelineError, opening with ``flag`` and ``ref``, if the reference is malformed, the module cannot be
    imported (or raises while importing) or has no such attribute.
    """
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise PipelineError(f"{flag} {ref!r}: expected package.module:name or path/to/file.py:name")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise PipelineError(f"{flag} {ref!r}: no file {path}")
        module_name = f"stoker_user_pipeline_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:
            raise PipelineError(f"{flag} {ref!r}: importing {path} raised {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise PipelineError(f"{flag} {ref!r}: cannot import {target} ({exc}); is it installed or on "
                                "PYTHONPATH?") from exc
        except Exception as exc:
            raise PipelineError(f"{flag} {ref!r}: importing {target} raised {type(exc).__name__}: {exc}") from exc
    found = getattr(module, attr, None)
    if found is None:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise PipelineError(f"{flag} {ref!r}: {target} has no {attr!r} (it has {', '.join(names[:12])})")
    return found


def _convert(value: str, parameter: inspect.Parameter, ref: str) -> Any:
    kind = parameter.annotation if parameter.annotation is not inspect.Parameter.empty else (
        type(parameter.default) if parameter.default not in (inspect.Parameter.empty, None) else str)
    if isinstance(kind, str):  # postponed annotations ("int")
        kind = {"int": int, "float": float, "bool": bool, "str": str}.get(kind, str)
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes", "on")
        if kind in (int, float):
            return kind(value)
    except ValueError:
        raise PipelineError(f"--pipeline-arg {parameter.name}={value}: {ref} expects {kind.__name__}") from None
    return value


def load_pipeline(ref: str, args: Mapping[str, str] | None = None, standard: Mapping[str, Any] | None = None) -> Pipeline:
    """Build the pipeline ``ref`` names with ``args`` (``--pipeline-arg`` strings, converted to the factory's types).

    ``standard`` (``mode``, ``image_size`` from ``stoker produce``) reaches the factory only for parameters it
    declares (or ``**kwargs``), and never overrides ``args``. PipelineError says what went wrong.
    """
    args, standard = dict(args or {}), dict(standard or {})
    found = resolve(ref)
    if isinstance(found, Pipeline):
        if args:
            raise PipelineError(f"--pipeline {ref!r} names a Pipeline, not a function: it takes no --pipeline-arg")
        return found
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):
        signature = None
    kwargs: dict[str, Any] = {}
    if signature is not None:
        params = signature.parameters
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for key, value in args.items():
            if key in params:
                kwargs[key] = _convert(value, params[key], ref)
            elif var_kw:
                kwargs[key] = value
            else:
                accepted = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
                raise PipelineError(f"--pipeline-arg {key}: {ref} takes {', '.join(accepted) or 'no arguments'}")
        for key, value in standard.items():
            if key not in kwargs and (key in params or var_kw):
                kwargs[key] = value
    else:
        kwargs = {**args}
    try:
        made = found(**kwargs)
    except PipelineError:
        raise
    except Exception as exc:
        raise PipelineError(f"--pipeline {ref!r}: making the pipeline raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(made, Pipeline):
        raise PipelineError(f"--pipeline {ref!r} returned {type(made).__name__}, expected a "
                            "stoker.producer.pipeline.Pipeline")
    if not made.name:
        made.name = ref
    return made
