"""Command-line settings generated from the config dataclasses, the way vLLM's engine args are.

Every field of :class:`EngineConfig` (but ``model``), :class:`RouterConfig` and
:class:`ClusterOptions` (but the fields in :data:`NOT_FLAGS`) becomes one flag of ``pdserve
serve`` and ``pdserve demo``:

1. Name: the field in kebab case (``max_num_batched_tokens`` -> ``--max-num-batched-tokens``,
   which is also vLLM's name for every engine setting both have), except :data:`RENAMES`.
2. Type from the annotation: ``int``, ``float``, ``str`` (with :data:`CHOICES` where the config
   validates a fixed set), ``bool`` as ``--x`` / ``--no-x``, ``dict`` as a JSON object
   (``--speculative-config '{"method": "ngram", ...}'``), ``tuple[str, ...]`` as one or more
   values (``--lora-modules a=/p/a b=/p/b``); ``X | None`` also takes ``none``.
3. Help: the field's comment in the dataclass source (trailing, with its continuation lines,
   or the comment lines above it) and the default the command starts from.
4. Default ``argparse.SUPPRESS``: only the flags a user passes reach the configs, so each
   dataclass keeps the single source of truth for its defaults.

:func:`options_from_args` builds the configs in the CLI process, so their validation errors
become :class:`SettingsError` naming the flags, before anything starts. A field added to one of
the dataclasses gets its flag with no edit here; one of a type no flag can carry raises
``TypeError`` when the parser is built (``tests/cli/test_settings.py`` builds it).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.cluster.autoscale.config import AutoscaleConfig, config_file_values
from pdserve.cluster.node_placement import PLACEMENTS
from pdserve.cluster.options import POOL_DEVICES, ClusterOptions
from pdserve.engine.config import DEFAULT_CPU_MEMORY_BUDGET, DTYPES, KV_CACHE_DTYPES, EngineConfig
from pdserve.kernels import BACKENDS
from pdserve.router.config import DISAGGREGATION_MODES, PREFILL_ROUTINGS
from pdserve.router.core import RouterConfig
from pdserve.router.tool_calling import TOOL_CALL_PARSERS

MiB = 1 << 20

# section -> (config class, help group title)
SECTIONS: dict[str, tuple[type, str]] = {
    "engine": (EngineConfig, "engine settings (EngineConfig; every worker)"),
    "router": (RouterConfig, "router settings (RouterConfig)"),
    "cluster": (ClusterOptions, "cluster settings (ClusterOptions)"),
    "autoscale": (AutoscaleConfig, "autoscaler settings (AutoscaleConfig; --autoscale turns it "
                                   "on; --autoscale-config FILE reads them from YAML, flags "
                                   "override the file)"),
}
# (section, field) that get no generated flag, and why
NOT_FLAGS: dict[tuple[str, str], str] = {
    ("engine", "model"): "ClusterOptions.model is --model",
    ("cluster", "engine"): "the engine settings are flags of their own",
    ("cluster", "router"): "the router settings are flags of their own",
    ("cluster", "autoscale"): "the autoscaler settings are flags of their own",
    ("cluster", "log_level"): "pdserve --log-level (before the command) sets it",
    ("engine", "prefix_cache_salt"): "a secret the launcher generates per cluster",
    ("cluster", "api_key"): "a secret: --api-key-file or $PDSERVE_API_KEY, never argv",
    ("cluster", "admin_api_key"): "a secret: --admin-api-key-file or $PDSERVE_ADMIN_API_KEY",
    ("cluster", "priority_api_keys"): "secrets: --priority-api-key-file or "
                                      "$PDSERVE_PRIORITY_API_KEYS",
    ("cluster", "redis_password"): "a secret: --redis-password-file or $PDSERVE_REDIS_PASSWORD",
    ("router", "scheduling_policy"): "--scheduling-policy sets it with the workers' (LINKED)",
}
# Values a str field accepts, where its config validates a fixed set.
CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("engine", "dtype"): ("auto", *DTYPES),
    ("engine", "device"): ("auto", "cpu", "cuda"),
    ("engine", "kv_cache_dtype"): KV_CACHE_DTYPES,
    ("engine", "attention_backend"): BACKENDS,
    ("engine", "scheduling_policy"): ("fcfs", "priority"),
    ("cluster", "pool_placement"): PLACEMENTS,
    ("cluster", "prefill_device"): POOL_DEVICES,
    ("cluster", "decode_device"): POOL_DEVICES,
    ("router", "prefill_routing"): PREFILL_ROUTINGS,
    ("router", "disaggregation"): DISAGGREGATION_MODES,
    ("cluster", "tool_call_parser"): TOOL_CALL_PARSERS,
}
# Metavars of the tuple flags (one or more values).
METAVARS: dict[tuple[str, str], str] = {
    ("cluster", "lora_modules"): "NAME=PATH",
}
# Help for fields whose source has no comment.
FALLBACK_HELP: dict[tuple[str, str], str] = {
    ("engine", "enable_prefix_caching"): "reuse the KV blocks of prompt prefixes already "
                                         "computed (decode workers always turn it off)",
    ("engine", "enable_chunked_prefill"): "split long prompts into chunks of at most "
                                          "--max-num-batched-tokens per step",
}


def _positive_mib(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


_positive_mib.__name__ = "positive MiB"  # argparse: "invalid positive MiB value: '0'"


@dataclass(frozen=True)
class Rename:
    """A flag that is not the field's kebab case (and maybe in other units)."""

    flag: str  # the flag, "--x"
    parse: Callable[[str], object] | None = None  # flag text -> flag value; None: by type
    to_field: Callable[[object], object] | None = None  # flag value -> field value
    to_flag: Callable[[object], object] | None = None  # field value -> flag value (help)
    unit: str = ""  # said in the help, e.g. "MiB"
    none_means: str = ""  # what the field's None default means, when its comment doesn't say


RENAMES: dict[tuple[str, str], Rename] = {
    ("engine", "memory_budget_bytes"): Rename(
        "--memory-budget-mib", _positive_mib, lambda mib: mib * MiB,
        lambda b: None if b is None else b // MiB, "MiB",
        f"free device memory on CUDA, {DEFAULT_CPU_MEMORY_BUDGET // MiB} on CPU"),
    ("cluster", "num_prefill"): Rename("--prefill"),
    ("cluster", "num_decode"): Rename("--decode"),
    ("cluster", "ttl_s"): Rename("--registry-ttl-s"),
    ("cluster", "num_routers"): Rename("--routers"),
    ("autoscale", "enabled"): Rename("--autoscale"),
    ("autoscale", "window_s"): Rename("--autoscale-window-s"),
    ("autoscale", "min_samples"): Rename("--autoscale-min-samples"),
    ("autoscale", "predictive"): Rename("--autoscale-predictive"),
    ("autoscale", "prefill_capacity_tokens_per_s"): Rename("--prefill-capacity-tokens-per-s",
                                                           unit="tokens/s"),
    ("autoscale", "decode_capacity_tokens_per_s"): Rename("--decode-capacity-tokens-per-s",
                                                          unit="tokens/s"),
}


class SettingsError(ValueError):
    """A setting's value is invalid; the message names the flags (as argparse's do)."""


@dataclass(frozen=True)
class Setting:
    """One config field as one flag."""

    section: str  # "engine" | "router" | "cluster": the config the value goes to
    name: str  # the dataclass field
    flag: str  # "--block-size"
    comment: str  # the field's comment in the source ("" when it has none)
    kind: type  # int | float | str | bool | dict | tuple (of str): the annotation without None
    optional: bool  # the annotation allows None (the flag takes "none")
    default: object  # the dataclass's own default
    choices: tuple[str, ...] | None = None
    rename: Rename | None = None

    @property
    def dest(self) -> str:
        return f"{self.section}:{self.name}"

    def parse(self, text: str):
        """Flag text -> field value (argparse calls it; ValueError = invalid value)."""
        if self.optional and text.lower() == "none":
            return None
        parse = {dict: _json_object, tuple: str}.get(self.kind, self.kind)
        value = (self.rename.parse if self.rename and self.rename.parse else parse)(text)
        if self.rename and self.rename.to_field:
            value = self.rename.to_field(value)
        return value

    def help(self, default, flags: dict[str, str] | None = None) -> str:
        """The comment (````field```` written as its flag, from ``flags``) and the default."""
        rename = self.rename or Rename(self.flag)
        text = self.comment or FALLBACK_HELP.get((self.section, self.name), "")
        text = re.sub(r"``(\w+)``", lambda m: (flags or {}).get(m.group(1), m.group(1)), text)
        shown = rename.to_flag(default) if rename.to_flag else default
        if shown is None and rename.none_means:
            shown = rename.none_means
        elif isinstance(shown, bool):
            shown = "on" if shown else "off"
        elif shown == "":
            shown = '""'
        elif shown == ():
            shown = "none"
        unit = f"in {rename.unit}; " if rename.unit else ""
        text = f"{text} ({unit}default: {shown})".strip()
        return text.replace("%", "%%")  # argparse formats help with %


def field_comments(cls: type) -> dict[str, str]:
    """field -> its comment in ``cls``'s source: the comments on the field's own lines, then
    the comment-only lines below them (their continuation) unless the next field has no comment
    of its own, in which case those lines are that field's (a comment above a field)."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    classdef = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef))
    fields = [node for node in classdef.body
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)]
    own = {node.target.id: [comments[n] for n in range(node.lineno, node.end_lineno + 1)
                            if n in comments] for node in fields}
    out = {name: list(parts) for name, parts in own.items()}
    previous = None
    for node in fields:
        above, line = [], node.lineno - 1
        while line > 0 and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        if previous is not None and own[previous] and own[node.target.id]:
            out[previous] += above  # continuation of the previous field's comment
        else:
            out[node.target.id] = above + out[node.target.id]
        previous = node.target.id
    return {name: " ".join(p for p in parts if p) for name, parts in out.items()}


def _kind(annotation) -> tuple[type, bool]:
    """(base type, allows None) of an annotation such as ``int | None``."""
    optional = False
    if typing.get_origin(annotation) in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        annotation = args[0] if len(args) == 1 else annotation
    if typing.get_origin(annotation) is tuple and typing.get_args(annotation) == (str, ...):
        return tuple, optional
    if annotation not in (int, float, str, bool, dict):
        raise TypeError(f"no flag type for {annotation!r}")
    return annotation, optional


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def all_settings() -> list[Setting]:
    """Every flag, generated from the dataclasses (see the module docstring)."""
    settings, flags = [], {}
    for section, (cls, _title) in SECTIONS.items():
        hints, comments = typing.get_type_hints(cls), field_comments(cls)
        for f in dataclasses.fields(cls):
            if (section, f.name) in NOT_FLAGS:
                continue
            try:
                kind, optional = _kind(hints[f.name])
            except TypeError as exc:
                raise TypeError(f"{cls.__name__}.{f.name}: {exc}; give it a supported type or "
                                f"list it in {__name__}.NOT_FLAGS") from None
            rename = RENAMES.get((section, f.name))
            flag = rename.flag if rename else "--" + f.name.replace("_", "-")
            if flag in flags:
                raise ValueError(f"{flag} would set both {flags[flag]} and {section}.{f.name}; "
                                 f"add a RENAMES entry in {__name__}")
            flags[flag] = f"{section}.{f.name}"
            settings.append(Setting(section, f.name, flag, comments.get(f.name, ""), kind,
                                    optional, _default(f), CHOICES.get((section, f.name)),
                                    rename))
    return settings


def _base_value(setting: Setting, base: ClusterOptions):
    if setting.section == "engine":
        return base.engine.get(setting.name, setting.default)
    owner = {"router": base.router, "autoscale": base.autoscale}.get(setting.section, base)
    return getattr(owner, setting.name, setting.default)


def add_setting_flags(parser: argparse.ArgumentParser, base: ClusterOptions) -> None:
    """Add every setting to ``parser``, in one help group per config; ``base`` holds the
    defaults the command starts from (shown in the help)."""
    groups = {section: parser.add_argument_group(title)
              for section, (_cls, title) in SECTIONS.items()}
    settings = all_settings()
    for section in SECTIONS:
        flags = {s.name: s.flag for s in settings if s.section == section}
        for s in (s for s in settings if s.section == section):
            _add_flag(groups[section], s, _base_value(s, base), flags)
    groups["autoscale"].add_argument(
        "--autoscale-config", dest="autoscale_config", metavar="FILE", default=argparse.SUPPRESS,
        help="YAML file of autoscaler settings: the Helm chart's autoscale values (camelCase, "
             "e.g. minPrefill, ttftSloMs; snake_case works too), optionally under an "
             "autoscale: key")


def _add_flag(group, s: Setting, default, flags: dict[str, str]) -> None:
    common = dict(dest=s.dest, default=argparse.SUPPRESS, help=s.help(default, flags))
    if s.kind is bool:
        group.add_argument(s.flag, action=argparse.BooleanOptionalAction, **common)
    elif s.kind is tuple:
        group.add_argument(s.flag, type=_named(s.parse, s), nargs="+", metavar=_metavar(s),
                           **common)
    else:
        group.add_argument(s.flag, type=_named(s.parse, s), choices=s.choices,
                           metavar=None if s.choices else _metavar(s), **common)


def _named(parse: Callable[[str], object], s: Setting) -> Callable[[str], object]:
    """``parse`` under the name argparse puts in "invalid <name> value: 'x'"."""

    def typed(text: str):
        return parse(text)

    name = (s.rename.parse.__name__ if s.rename and s.rename.parse
            else "JSON object" if s.kind is dict else "str" if s.kind is tuple
            else s.kind.__name__)
    typed.__name__ = f"{name} (or none)" if s.optional else name
    return typed


def _metavar(s: Setting) -> str:
    if s.rename and s.rename.unit:
        return s.rename.unit.upper()
    if s.kind is float and s.name.endswith("_s"):
        return "SECONDS"
    return {int: "N", float: "X", str: s.name.upper(), dict: "JSON",
            tuple: METAVARS.get((s.section, s.name), "VALUE")}[s.kind]


def _json_object(text: str) -> dict:
    """A ``dict`` field's flag: a JSON object (ValueError otherwise)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(text)
    return value


@dataclass
class Overrides:
    """The settings a user passed, per config, as field values."""

    engine: dict = dataclasses.field(default_factory=dict)
    router: dict = dataclasses.field(default_factory=dict)
    cluster: dict = dataclasses.field(default_factory=dict)
    autoscale: dict = dataclasses.field(default_factory=dict)


def overrides_from_args(args: argparse.Namespace) -> Overrides:
    """Only the flags present on the command line (and the ``--autoscale-config`` file's
    values, under the flags)."""
    out = Overrides()
    for dest, value in vars(args).items():
        section, sep, name = dest.partition(":")
        if sep and section in SECTIONS:
            getattr(out, section)[name] = value
    path = getattr(args, "autoscale_config", None)
    if path is not None:
        try:
            out.autoscale = {**config_file_values(path), **out.autoscale}
        except (OSError, ValueError) as exc:
            raise SettingsError(f"argument --autoscale-config: {exc}") from None
    return out


# One flag, several configs: (section, field) of the flag -> the other (section, field) it sets.
LINKED: dict[tuple[str, str], tuple[str, str]] = {
    ("engine", "scheduling_policy"): ("router", "scheduling_policy"),  # both pools + router
}


def apply_overrides(base: ClusterOptions, overrides: Overrides) -> ClusterOptions:
    """``base`` with ``overrides`` applied; every config built once here, so a bad value raises
    :class:`SettingsError` naming its flags before anything starts."""
    for (section, name), (to_section, to_name) in LINKED.items():
        if name in getattr(overrides, section):
            getattr(overrides, to_section).setdefault(to_name, getattr(overrides, section)[name])
    options = _built("cluster", lambda: dataclasses.replace(
        base, engine={**base.engine, **overrides.engine},
        router=_built("router", lambda: dataclasses.replace(base.router, **overrides.router)),
        autoscale=_built("autoscale", lambda: dataclasses.replace(base.autoscale,
                                                                  **overrides.autoscale)),
        **overrides.cluster))
    _built("engine", lambda: engine_config(options))
    return options


def options_from_args(args: argparse.Namespace, base: ClusterOptions) -> ClusterOptions:
    return apply_overrides(base, overrides_from_args(args))


def engine_config(options: ClusterOptions, model: str | None = None) -> EngineConfig:
    """The workers' EngineConfig (``model`` defaults to ``options.model``, "" if None)."""
    return EngineConfig(model=model or options.model or "", **options.engine)


def _built(section: str, build: Callable[[], object]):
    try:
        return build()
    except SettingsError:
        raise
    except ValueError as exc:
        # ClusterOptions holds the engine settings too, and its checks may name them
        sections = (section, "engine") if section == "cluster" else (section,)
        raise SettingsError(name_flags(sections, str(exc))) from None


def name_flags(section: str | tuple[str, ...], message: str) -> str:
    """``message`` (a config's ValueError) prefixed with the flags of the fields it names
    (fields of ``section``, or of any of several)."""
    if message.startswith("argument"):
        return message
    sections = (section,) if isinstance(section, str) else section
    flags = {}
    for s in all_settings():
        if s.section in sections:
            match = re.search(rf"(?<![\w-]){re.escape(s.name)}(?![\w-])", message)
            if match:
                flags[s.flag] = match.start()
    if not flags:
        return message
    names = sorted(flags, key=flags.get)
    return f"argument{'s' if len(names) > 1 else ''} {', '.join(names)}: {message}"
