"""Hardware profiles of the roofline cost model: small TOML files a user can copy and edit.

A profile gives the peak arithmetic rate, the memory bandwidth, the cost of a kernel
launch and, per kernel family, the fraction of peak that family reaches (``[efficiency]``)
and, optionally, the fraction of the bandwidth it reaches (``[bandwidth_efficiency]``:
above 1 when its data sits in cache; ``egraft calibrate --kernels`` fits both). Shipped
profiles live in ``egraft/extract/profiles/`` (``cpu-host`` with figures measured on a 2-core
znver3, ``cuda-h200`` from the datasheet); ``egraft calibrate`` measures this machine and saves
``cpu-host`` in the user's config dir (``$EGRAFT_CONFIG_DIR``, else
``$XDG_CONFIG_HOME/egraft``, else ``~/.config/egraft``), where it takes precedence.

Example:
    >>> p = load_profile("cuda-h200")
    >>> p.peak_gflops, p.bandwidth_gbs
    (67000.0, 4800.0)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from egraft.errors import EgraftError
from egraft.ir.work import FAMILIES, PARENT_FAMILY

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SHIPPED_DIR = Path(__file__).parent / "profiles"
#: The profile each target uses when none is named.
TARGET_PROFILES = {"cpu": "cpu-host", "cuda": "cuda-h200"}


@dataclass(frozen=True)
class Profile:
    """A roofline profile.

    Attributes:
        name: the profile's name (``cpu-host``).
        target: ``cpu`` or ``cuda``.
        peak_gflops: peak arithmetic, GFLOP/s.
        bandwidth_gbs: memory bandwidth, GB/s.
        launch_us: microseconds to start one kernel.
        efficiency: kernel family -> fraction of the peak it reaches (missing = 1.0).
        bandwidth_efficiency: kernel family -> multiple of ``bandwidth_gbs`` it moves data at
            (missing = 1.0; above 1 when its working set stays in cache).
        call_us: kernel family -> microseconds each call costs beyond its roofline and
            ``launch_us`` (missing = 0): what a kernel pays per call inside a model that its
            flops and bytes do not show (Winograd's three passes over private buffers).
        unavailable: kernel families the target has no kernels for (``conv_nchwc`` on a GPU):
            extraction never picks them (their cost is infinite).
        description: one line on what the figures describe.
        source: where the figures come from (``placeholder``, ``measured 2026-12-02``...).
        path: the file it was read from.
    """

    name: str
    target: str
    peak_gflops: float
    bandwidth_gbs: float
    launch_us: float
    efficiency: dict[str, float] = field(default_factory=dict)
    bandwidth_efficiency: dict[str, float] = field(default_factory=dict)
    call_us: dict[str, float] = field(default_factory=dict)
    unavailable: tuple[str, ...] = ()
    description: str = ""
    source: str = ""
    path: str = ""

    def family_efficiency(self, family: str) -> float:
        return _of_family(self.efficiency, family, 1.0)

    def family_call_us(self, family: str) -> float:
        """Microseconds a call of ``family`` costs beyond its roofline and the launch."""
        return _of_family(self.call_us, family, 0.0)

    def family_bandwidth(self, family: str) -> float:
        """GB/s a kernel of ``family`` moves data at."""
        return self.bandwidth_gbs * _of_family(self.bandwidth_efficiency, family, 1.0)

    def settings(self) -> dict:
        """The profile as plain data (recorded in plans; ``bandwidth_efficiency`` only when set)."""
        out = {"name": self.name, "target": self.target, "peak_gflops": self.peak_gflops,
               "bandwidth_gbs": self.bandwidth_gbs, "launch_us": self.launch_us,
               "efficiency": {k: self.efficiency[k] for k in sorted(self.efficiency)}, "source": self.source}
        if self.bandwidth_efficiency:
            out["bandwidth_efficiency"] = {k: self.bandwidth_efficiency[k] for k in sorted(self.bandwidth_efficiency)}
        if self.call_us:
            out["call_us"] = {k: self.call_us[k] for k in sorted(self.call_us)}
        if self.unavailable:
            out["unavailable"] = sorted(self.unavailable)
        return out

    def to_toml(self) -> str:
        """The profile as a TOML file that :func:`load_profile` reads back."""
        lines = [f"# {self.name}: {self.description}" if self.description else f"# {self.name}",
                 f"name = {_quote(self.name)}", f"target = {_quote(self.target)}",
                 f"description = {_quote(self.description)}",
                 "# Peak fp32 arithmetic, GFLOP/s (a fused multiply-add counts 2).",
                 f"peak_gflops = {self.peak_gflops!r}",
                 "# Sustained memory bandwidth, GB/s (bytes read plus bytes written).",
                 f"bandwidth_gbs = {self.bandwidth_gbs!r}",
                 "# Cost of starting one kernel, microseconds.",
                 f"launch_us = {self.launch_us!r}", f"source = {_quote(self.source)}"]
        if self.unavailable:
            lines += ["# Kernel families the target has no kernels for (never extracted).",
                      "unavailable = [" + ", ".join(_quote(f) for f in sorted(self.unavailable)) + "]"]
        lines += ["",
                 "# The fraction of peak_gflops each kernel family reaches.", "[efficiency]"]
        lines += [f"{k} = {float(self.family_efficiency(k))!r}" for k in FAMILIES]
        if self.bandwidth_efficiency:
            lines += ["", "# The multiple of bandwidth_gbs each kernel family moves data at (above 1: in cache).",
                      "[bandwidth_efficiency]"]
            lines += [f"{k} = {float(v)!r}" for k in FAMILIES
                      if (v := self.bandwidth_efficiency.get(k)) is not None]
        if self.call_us:
            lines += ["", "# Microseconds each call of a kernel family costs beyond its roofline and launch_us.",
                      "[call_us]"]
            lines += [f"{k} = {float(v)!r}" for k in FAMILIES if (v := self.call_us.get(k)) is not None]
        return "\n".join(lines) + "\n"


def _of_family(table: dict[str, float], family: str, default: float) -> float:
    """``table[family]``, else its parent family's entry (:data:`egraft.ir.work.PARENT_FAMILY`), else ``default``."""
    if family in table:
        return table[family]
    parent = PARENT_FAMILY.get(family)
    return table.get(parent, default) if parent else default


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_dir() -> Path:
    """egraft's per-user config dir (profiles are saved under ``profiles/``)."""
    if os.environ.get("EGRAFT_CONFIG_DIR"):
        return Path(os.environ["EGRAFT_CONFIG_DIR"])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "egraft"


def user_profile_path(name: str) -> Path:
    return config_dir() / "profiles" / f"{name}.toml"


def profile_names() -> list[str]:
    """The names of every shipped or saved profile."""
    names = {p.stem for p in SHIPPED_DIR.glob("*.toml")}
    user = config_dir() / "profiles"
    if user.is_dir():
        names |= {p.stem for p in user.glob("*.toml")}
    return sorted(names)


def find_profile(name_or_path: str) -> Path:
    """The file of a profile: a path to a ``.toml`` file, else a saved profile of that name,
    else a shipped one."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or "/" in name_or_path:
        if not path.is_file():
            raise EgraftError(f"--profile {name_or_path}: no such file")
        return path
    for candidate in (user_profile_path(name_or_path), SHIPPED_DIR / f"{name_or_path}.toml"):
        if candidate.is_file():
            return candidate
    raise EgraftError(f"--profile {name_or_path}: no such profile; known: {', '.join(profile_names())} "
                      "(or give a path to a .toml file)")


_NUMBERS = ("peak_gflops", "bandwidth_gbs", "launch_us")
_STRINGS = ("name", "target", "description", "source")


def _family_table(data: dict, path: Path, key: str, valid: Callable[[float], bool], expected: str) -> dict[str, float]:
    """The table ``[key]`` of kernel family -> number (empty when absent), each family known
    and each number ``valid``; anything else raises an error naming the file and the key."""
    table = data.get(key, {})
    if not isinstance(table, dict):
        raise EgraftError(f"{path}: {key} must be a table ([{key}])")
    for family, value in table.items():
        if family not in FAMILIES:
            raise EgraftError(f"{path}: {key}.{family}: unknown kernel family; known: {', '.join(FAMILIES)}")
        if not isinstance(value, int | float) or isinstance(value, bool) or not valid(value):
            raise EgraftError(f"{path}: {key}.{family} = {value!r}; expected {expected}")
    return {family: float(value) for family, value in table.items()}


def load_profile(name_or_path: str) -> Profile:
    """Read a profile by name or path; a malformed file raises an error naming the file and key."""
    path = find_profile(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise EgraftError(f"{path}: not valid TOML: {e}") from None
    known = {f.name for f in fields(Profile)} - {"path"}
    for key in data:
        if key not in known:
            raise EgraftError(f"{path}: unknown key {key!r}; a profile has {sorted(known)}")
    for key in _NUMBERS:
        if key not in data:
            raise EgraftError(f"{path}: missing {key} (a number)")
        value = data[key]
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0 or \
                (key != "launch_us" and value == 0):
            raise EgraftError(f"{path}: {key} = {value!r}; expected a positive number")
    for key in _STRINGS:
        if key in data and not isinstance(data[key], str):
            raise EgraftError(f"{path}: {key} = {data[key]!r}; expected a string")
    if data.get("target", "cpu") not in TARGET_PROFILES:
        raise EgraftError(f"{path}: target = {data['target']!r}; expected one of {sorted(TARGET_PROFILES)}")
    efficiency = _family_table(data, path, "efficiency", lambda v: 0 < v <= 1, "a fraction in (0, 1]")
    bandwidth = _family_table(data, path, "bandwidth_efficiency", lambda v: v > 0, "a positive number")
    call_us = _family_table(data, path, "call_us", lambda v: v >= 0, "a number of microseconds >= 0")
    unavailable = data.get("unavailable", [])
    if not isinstance(unavailable, list) or any(f not in FAMILIES for f in unavailable):
        raise EgraftError(f"{path}: unavailable = {unavailable!r}; expected a list of kernel families "
                          f"({', '.join(FAMILIES)})")
    return Profile(name=data.get("name", path.stem), target=data.get("target", "cpu"),
                   peak_gflops=float(data["peak_gflops"]), bandwidth_gbs=float(data["bandwidth_gbs"]),
                   launch_us=float(data["launch_us"]),
                   efficiency=efficiency, bandwidth_efficiency=bandwidth, call_us=call_us,
                   unavailable=tuple(sorted(unavailable)), description=data.get("description", ""),
                   source=data.get("source", ""), path=str(path))


def save_profile(profile: Profile, force: bool = False) -> Path:
    """Write ``profile`` to the user's config dir; an existing file is kept unless ``force``."""
    path = user_profile_path(profile.name)
    if path.exists() and not force:
        raise EgraftError(f"{path} exists (a saved profile); pass --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_toml())
    return path


__all__ = ["Profile", "load_profile", "save_profile", "find_profile", "profile_names", "config_dir"]
