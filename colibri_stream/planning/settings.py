"""Every setting a budget file or a flag sets, declared once: one ``Setting`` row each in ``SETTINGS`` (budget
key, flag, type, default, range, help). Generated from the table: the flags (cli/options.py), the budget-file
check (``load_budget_file``: each error one line naming the file and the key), the settings table in
docs/planning.md (``markdown_table``; a test holds the two equal) and a local worker's store flags
(``store_flags``).

A store setting's default and range are those of its StoreConfig field (storage/tiers/config.py: storage is used
without this package, and a StoreConfig built there is checked the same); its row names the field and reads
them, and so for the prefix cache's PrefixConfig. A new store setting is its StoreConfig field and one row
(tests then ask for the docs table regenerated and the key in the README's budget example).
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, cast

from colibri_stream.errors import BudgetError
from storage.errors import FormatError
from storage.files.safe_read import decode_utf8, read_bounded
from storage.kv.prefix_store import PrefixConfig
from storage.tiers.config import CHOICES, RANGE, StoreConfig

# What a budget file or a flag gives: TOML's strings, integers and booleans; a caller may give a Path.
Value = str | int | bool | Path | None
MAX_BUDGET_FILE_BYTES = 1 << 20  # a budget is a dozen keys; anything near this size is not one
DEFAULT_RAM = "100%"  # --ram without a budget file: every expert (the planning commands size `auto` instead)


class Kind(Enum):
    """How a setting's value is written, checked and handed on."""

    SWITCH = "switch"  # on/off: --X / --no-X
    COUNT = "count"  # an integer in the row's range
    CHOICE = "choice"  # one of the row's choices
    SIZE = "size"  # bytes: 8GiB, 512MB, 25% of the routed-expert bytes (auto where the row allows)
    BLOCKS = "bytes"  # bytes with nothing to be a percentage of: 512MiB, 0
    PATH = "path"  # a file
    TEXT = "text"  # a name (a device)

    @property
    def types(self) -> tuple[type, ...]:
        """The TOML types a budget file may give it."""
        return _TOML_TYPES[self]


_TOML_TYPES = {Kind.SWITCH: (bool,), Kind.COUNT: (int,), Kind.SIZE: (str, int), Kind.BLOCKS: (str, int)}
_TOML_TYPES |= {Kind.CHOICE: (str,), Kind.PATH: (str,), Kind.TEXT: (str,)}
Owner = type[StoreConfig] | type[PrefixConfig]


@dataclass(frozen=True)
class Setting:
    """One setting: where a user writes it and what it may be. ``name`` is how code asks for it
    (``StoreOptions(preload=False)``, ``budget["preload"]``)."""

    name: str
    key: str | None  # "table.key" in a budget file; None: a flag only
    flag: str
    kind: Kind
    help: str  # what it does; the flag's help and the docs add the default
    owner: Owner | None = None  # the config whose ``target`` field it sets, and whose default and range it has
    target: str = ""
    default: Value = None  # the row's own (``owner`` None); otherwise read from the owner's field
    shown: str = ""  # the default in words, where it is not a value (the device this machine has)
    low: int | None = None  # COUNT's range (``owner`` None); otherwise read from the owner's field
    high: int | None = None
    choices: tuple[str, ...] = ()
    auto: bool = False  # SIZE: "auto" (what is available) is allowed
    off_flag: str = ""  # SWITCH: the flag that turns it off where it is not --no-X (--buffered)
    off_help: str = ""
    unit: str = ""  # COUNT: what is counted, in the flag's error ("disk reader threads")
    metavar: str | None = None
    group: str = "store"  # which flags it is among: store, prefix, context (cli/options.py adds each group)

    def __post_init__(self) -> None:
        if self.owner is None:
            return
        if (self.default, self.low, self.high, self.choices) != (None, None, None, ()):
            raise ValueError(f"setting {self.name}: its default and range are {self.owner.__name__}'s, not restated")
        spec = {f.name: f for f in fields(self.owner)}[self.target]  # a misspelt target fails at import
        set_ = object.__setattr__  # the row is frozen: what it reads from its owner is set once, here
        if spec.default is not MISSING:
            set_(self, "default", spec.default)
        set_(self, "low", spec.metadata.get(RANGE, (None, None))[0])
        set_(self, "high", spec.metadata.get(RANGE, (None, None))[1])
        set_(self, "choices", tuple(spec.metadata.get(CHOICES, ())))

    def check(self, value: Value, where: str) -> None:
        """Refuse a value its type allows but its range does not, naming ``where`` (the key or flag)."""
        if self.choices and value not in self.choices:
            raise BudgetError(f"{where} must be one of {', '.join(self.choices)}, got {value!r}")
        if self.kind is Kind.COUNT and isinstance(value, int):
            if self.low is not None and value < self.low or self.high is not None and value > self.high:
                bound = f"{self.low}..{self.high}" if self.high is not None else f">= {self.low}"
                raise BudgetError(f"{where} must be {bound}, got {value}")
        if self.kind is Kind.SIZE and isinstance(value, str | int):
            parse_size(value, 0, where, auto_bytes=0 if self.auto else None)  # the form: % and auto need the model
        if self.kind is Kind.BLOCKS and isinstance(value, str | int):
            prefix_size(value, where)

    def show(self, value: Value) -> str:
        """A value as a user would write it: 8GiB, on, frequent ('' for None)."""
        if isinstance(value, bool):
            return "on" if value else "off"
        if self.kind is Kind.BLOCKS and isinstance(value, int):
            return binary_size(value)
        return "" if value is None else str(value)

    def shown_default(self) -> str:
        """The default as a user would write it; the words where it is not a value (the device)."""
        return self.shown or self.show(self.default)

    def range_text(self) -> str:
        if self.choices:
            return ", ".join(self.choices)
        if self.low is not None:
            return f"{self.low}..{self.high}" if self.high is not None else f">= {self.low}"
        sizes = {Kind.SIZE: "size, % or auto" if self.auto else "size or %", Kind.BLOCKS: "size, not % or auto"}
        return sizes.get(self.kind, "")


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "ram", "memory.ram", "--ram", Kind.SIZE, default=DEFAULT_RAM, auto=True,
        help="RAM for expert slots: 8GiB, 512MB, 25% (of expert bytes) or auto",
    ),
    Setting(
        "vram", "memory.vram", "--vram", Kind.SIZE, owner=StoreConfig, target="vram_bytes",
        help="VRAM for expert slots, same forms as --ram; 0: no VRAM tier",
    ),
    # A flag only: the device is this machine's, and a budget file may be written for another.
    Setting(
        "vram_device", None, "--vram-device", Kind.TEXT, owner=StoreConfig, target="vram_device",
        shown="cuda where available, else cpu standing in", help="device of the VRAM tier",
    ),
    Setting(
        "policy", "cache.policy", "--policy", Kind.CHOICE, owner=StoreConfig, target="policy",
        help="which RAM expert leaves when a read needs its slot: frequent (fewest recent routings), lru, hybrid, "
        "or pinned (lru plus the --history's hottest experts held for good)",
    ),
    Setting(
        "prefetch", "cache.prefetch", "--prefetch", Kind.SWITCH, owner=StoreConfig, target="prefetch",
        help="router-guided prefetch",
    ),
    Setting(
        "prefetch_layers", "cache.prefetch_layers", "--prefetch-layers", Kind.COUNT, owner=StoreConfig,
        target="prefetch_layers", unit="MoE layers", metavar="N",
        help="MoE layers ahead whose experts decode guesses and prefetches: the next layer's guess is the best, "
        "a later one's read has longer to land",
    ),
    Setting(
        "half_life", "cache.half_life", "--half-life", Kind.COUNT, owner=StoreConfig, target="half_life",
        unit="tokens", metavar="N",
        help="the frequent policy's routing counts halve every N tokens' worth of routed uses: shorter follows a "
        "conversation that moves on sooner, longer keeps experts hot across it",
    ),
    Setting(
        "preload", "cache.preload", "--preload", Kind.SWITCH, owner=StoreConfig, target="preload",
        help="when --ram holds every expert, read them all at load rather than as prompts need them",
    ),
    Setting(
        "direct", "io.direct", "--direct", Kind.SWITCH, owner=StoreConfig, target="direct",
        help="read experts past the page cache (O_DIRECT; F_NOCACHE on macOS) where the filesystem allows",
        off_flag="--buffered", off_help="read experts through the page cache",
    ),
    Setting(
        "threads", "io.threads", "--io-threads", Kind.COUNT, owner=StoreConfig, target="threads",
        unit="disk reader threads", metavar="IO_THREADS", help="disk reader threads (per device of a spread container)",
    ),
    Setting(
        "history", "cache.history", "--history", Kind.PATH, owner=StoreConfig, target="history_path",
        help="usage-history file (learned hot store), updated after every turn",
    ),
    Setting(
        "context", "kv.context", "--context", Kind.COUNT, low=1, unit="positions", metavar="N", group="context",
        shown="the budget file's [kv] context, else the model's max_position_embeddings, which is also the most N "
        "may be",
        help="tokens of context (prompt + answer) the KV cache and activations are sized for; a longer prompt "
        "is refused, answers are cut to fit",
    ),
    Setting(
        "prefix_ram", "prefix.ram", "--prefix-ram", Kind.BLOCKS, owner=PrefixConfig, target="ram_bytes",
        metavar="SIZE", group="prefix", help="RAM for recently used prefix blocks; 0: none",
    ),
    Setting(
        "prefix_disk", "prefix.disk", "--prefix-disk", Kind.BLOCKS, owner=PrefixConfig, target="disk_bytes",
        metavar="SIZE", group="prefix",
        help="prefix blocks kept in the KV directory, least recently used dropped first; 0: none",
    ),
    Setting(
        "prefix_enabled", "prefix.enabled", "--prefix-cache", Kind.SWITCH, owner=PrefixConfig, target="enabled",
        group="prefix", help="restore the longest cached prefix of each prompt and remember what each turn "
        "computes (--no-prefix-cache computes every prompt whole)",
    ),
    Setting(
        "prefix_shared", "prefix.shared", "--shared-prefix-cache", Kind.SWITCH, owner=PrefixConfig, target="shared",
        group="prefix", help="`serve` with API keys: one prefix cache for every key (one user's several keys); "
        "off, each key's cached prefixes are its own, so no key learns what another's prompts began with",
    ),
    Setting(
        "default_max_tokens", "serve.default_max_tokens", "--default-max-tokens", Kind.COUNT, default=4096, low=1,
        unit="tokens", metavar="N", group="serve",
        help="answer length of a request that sets none (max_tokens, max_completion_tokens, max_output_tokens): "
        "clients such as Aider send none, and the rest of a long context is minutes of decoding; cut to the "
        "room the context leaves",
    ),
)  # fmt: skip
BY_NAME: Mapping[str, Setting] = MappingProxyType({s.name: s for s in SETTINGS})
BY_KEY: Mapping[str, Setting] = MappingProxyType({s.key: s for s in SETTINGS if s.key is not None})
TABLES = sorted({key.split(".")[0] for key in BY_KEY})
# Every key a budget file may hold: "table.key" -> (setting name, TOML types accepted).
BUDGET_KEYS: Mapping[str, tuple[str, tuple[type, ...]]] = {k: (s.name, s.kind.types) for k, s in BY_KEY.items()}
# Settings that are not a budget's: refused with where they are set, rather than read by nothing.
_SET_ELSEWHERE = {"kv.dir": "--kv-dir", "kv.dtype": "--kv-dtype"}
_BY_BARE_KEY: dict[str, str] = {}  # "ram" -> "memory.ram": a bare key's first table in the table above
for _key in BY_KEY:
    _BY_BARE_KEY.setdefault(_key.split(".", 1)[1], _key)


@dataclass(frozen=True)
class Budget:
    """What a budget file sets (setting name -> value, each checked against its row); ``Budget()``: no file.
    ``budget[name]`` is the file's value, else the row's default."""

    values: Mapping[str, Value] = field(default_factory=dict)
    path: str | None = None

    @property
    def source(self) -> str:
        return self.path or "defaults"

    def __getitem__(self, name: str) -> Value:
        return self.values[name] if name in self.values else BY_NAME[name].default


def load_budget_file(path: str | Path) -> Budget:
    """The budget file at ``path``, read and checked: an unknown table or key, a wrong type or a value out
    of range is a BudgetError naming the file and the key (and the valid key closest to a misspelt one)."""
    path = Path(path)
    values: dict[str, Value] = {}
    for table, content in read_budget_toml(path).items():
        if not isinstance(content, dict):
            raise BudgetError(f"{path}: key {table} is outside a table{_closest(table, _BY_BARE_KEY)}")
        for key, value in content.items():
            setting = _known_key(path, f"{table}.{key}")
            types = setting.kind.types
            if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
                raise BudgetError(f"{path}: {setting.key} must be {' or '.join(t.__name__ for t in types)}")
            values[setting.name] = cast(Value, value)  # one of the row's types, checked above
    for name, checked in values.items():  # every key's type first, then the ranges
        BY_NAME[name].check(checked, f"{path}: {BY_NAME[name].key}")
    return Budget(MappingProxyType(values), str(path))


def read_budget_toml(path: Path) -> dict[str, Any]:
    """The one place a budget file is read (tests count the calls: a command reads its file once)."""
    try:
        text = decode_utf8(read_bounded(path, MAX_BUDGET_FILE_BYTES, "budget file"), path, "budget file")
        return tomllib.loads(text)
    except FileNotFoundError:
        raise BudgetError(f"{path}: budget file not found") from None
    except FormatError as exc:  # a directory, FIFO or device; too large; not UTF-8
        raise BudgetError(str(exc)) from None
    except tomllib.TOMLDecodeError as exc:
        raise BudgetError(f"{path}: not valid TOML ({exc})") from None
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise BudgetError(f"{path}: not valid TOML (arrays or tables nested too deeply)") from None


def _known_key(path: Path, name: str) -> Setting:
    """The row of ``table.key``; anything else is a BudgetError naming it, with the valid key closest to it."""
    if name in BY_KEY:
        return BY_KEY[name]
    if name in _SET_ELSEWHERE:
        raise BudgetError(f"{path}: {name} is not a budget setting; use {_SET_ELSEWHERE[name]}")
    table, key = name.split(".", 1)
    if table not in TABLES:
        hint = _closest(name, {k: k for k in BY_KEY}) or _closest(key, _BY_BARE_KEY)
        known = ", ".join(f"[{t}]" for t in TABLES)
        raise BudgetError(f"{path}: unknown table [{table}] in {name}{hint or f' (a budget file has {known})'}")
    same_table = {k.split(".", 1)[1]: k for k in BY_KEY if k.startswith(f"{table}.")}
    hint = _closest(key, same_table) or _closest(key, _BY_BARE_KEY)  # misspelt, or in the wrong table
    known = ", ".join(same_table.values())
    raise BudgetError(f"{path}: unknown key {name}{hint or f' (known: {known})'}")


def _closest(word: str, choices: Mapping[str, str]) -> str:
    """' (did you mean memory.ram?)' for the choice whose name is closest to ``word``; '' when none is."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {choices[close[0]]}?)" if close else ""


def owned_values(
    owner: Owner, value: Callable[[str], Value], size: Callable[[Setting, str | int], int]
) -> dict[str, Any]:
    """``owner``'s fields as the settings it owns give them (``value(name)``; None leaves the field's
    default), sizes turned into bytes by ``size``: keyword arguments for ``dataclasses.replace``."""
    given: dict[str, Any] = {}  # Any: each value has its own field's type, checked by the owner
    for setting in SETTINGS:
        v = value(setting.name) if setting.owner is owner else None
        if v is None:
            continue
        if setting.kind in (Kind.SIZE, Kind.BLOCKS) and isinstance(v, str | int):
            given[setting.target] = size(setting, v)
        elif setting.kind is Kind.PATH and isinstance(v, str | Path):
            given[setting.target] = Path(v)
        else:
            given[setting.target] = v
    return given


def store_flags(config: StoreConfig, instead: Mapping[str, object]) -> list[str]:
    """The flags that give ``config`` to another process (a local worker): every StoreConfig row, so a new
    store setting reaches the workers too, with ``instead``'s values (setting name -> value: the worker's
    RAM share, its own usage-history file) over the config's. A value of None gives no flag."""
    flags: list[str] = []
    for setting in SETTINGS:
        if setting.owner is not StoreConfig and setting.name not in instead:
            continue
        value: object = instead[setting.name] if setting.name in instead else vars(config)[setting.target]
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(setting.flag if value else setting.off_flag or f"--no-{setting.flag[2:]}")
        else:
            flags += [setting.flag, str(value)]
    return flags


def markdown_table(rows: Iterable[Setting] = SETTINGS) -> str:
    """The settings table of docs/planning.md, generated: one line per setting."""
    lines = ["| budget key | flag | type | default | range | what it sets |", "|---|---|---|---|---|---|"]
    for s in rows:
        flag = f"`{s.flag}` / `{s.off_flag or '--no-' + s.flag[2:]}`" if s.kind is Kind.SWITCH else f"`{s.flag}`"
        key = f"`{s.key}`" if s.key else "(a flag only)"
        default = s.shown_default() or "none"
        line = f"| {key} | {flag} | {s.kind.value} | {default} | {s.range_text()} | {s.help} |"
        lines.append(line)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- sizes
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int, expert_bytes: int, key: str = "size", auto_bytes: int | None = None) -> int:
    """Bytes from 123, "8GiB", "512MB", "25%" (of expert_bytes) or "auto" (needs auto_bytes)."""
    if isinstance(value, bool):
        raise BudgetError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int):
        return value
    text = str(value).strip()
    if text == "auto":
        if auto_bytes is None:
            raise BudgetError(f"{key}: 'auto' is not available here")
        return auto_bytes
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise BudgetError(f"{key}: bad percentage {value!r}") from None
        if not (math.isfinite(percent) and percent >= 0):  # float() also reads "inf", "nan", "-5"
            raise BudgetError(f"{key}: bad percentage {value!r} (a finite number >= 0, e.g. 25%)")
        return int(expert_bytes * percent / 100)
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise BudgetError(f"{key}: bad size {value!r} (use e.g. 8GiB, 512MB, 25%, auto)")
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(size):  # 400 digits read as a float are inf
        raise BudgetError(f"{key}: size {value!r} is too large")
    return int(size)


def prefix_size(value: str | int, key: str) -> int:
    """A prefix-cache budget: a size (0 turns the tier off); a percentage or auto has nothing to be of."""
    if isinstance(value, str) and value.strip().endswith("%") or str(value).strip() == "auto":
        raise BudgetError(f"{key}: expected a size such as 512MiB or 0, got {value!r}")
    return parse_size(value, 0, key)


def binary_size(value: int) -> str:
    """8589934592 -> "8GiB" (a default shown the way a user would write it)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale and value % scale == 0:
            return f"{value // scale}{unit}"
    return str(value)
