"""The docs' reference pages are generated from the code (tools/gen_refs.py) and committed: they
cannot drift from it (issue 35). A config key added without its description in conf/quilld.toml,
a flag, a default or a metric changed without the pages made again: each fails here."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gen_refs  # noqa: E402  (tools/ is not a package)

from quilld import config  # noqa: E402
from quilld.cli import FLAGS, _parser  # noqa: E402


@pytest.mark.parametrize("page, make", gen_refs.PAGES, ids=lambda x: getattr(x, "name", ""))
def test_the_committed_reference_page_is_what_the_code_makes_now(page, make):
    assert page.exists(), f"{page.relative_to(ROOT)} is missing: run python tools/gen_refs.py"
    assert page.read_text() == make(), f"{page.relative_to(ROOT)} is out of date: run python tools/gen_refs.py"


def test_the_check_mode_says_which_page_is_stale(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "metrics.md"
    stale.write_text("# Metrics\n")
    monkeypatch.setattr(gen_refs, "PAGES", ((stale, gen_refs.metrics_page),))
    monkeypatch.setattr(gen_refs, "ROOT", tmp_path)
    assert gen_refs.main(["--check"]) == 1
    assert "metrics.md" in capsys.readouterr().err
    assert stale.read_text() == "# Metrics\n"  # --check writes nothing


def sections() -> dict[str, list[str]]:
    return {f.name: [g.name for g in dataclasses.fields(f.default_factory())]  # type: ignore[misc]
            for f in dataclasses.fields(config.Config) if f.name != "engines"}


def test_every_config_key_has_its_description_in_the_sample_and_on_the_page():
    described, engine_described = gen_refs.sample_descriptions((ROOT / "conf" / "quilld.toml").read_text())
    page = gen_refs.configuration_page()
    for section, keys in sections().items():
        for key in keys:
            assert described.get((section, key)), f"{section}.{key} has no comment in conf/quilld.toml"
            assert f"### `{section}.{key}`" in page
    aliases = {field: key for key, field in config.ENGINE_KEY_ALIASES.items()}
    for f in dataclasses.fields(config.EngineConfig):
        key = aliases.get(f.name, f.name)
        assert engine_described.get(key), f"engine key {key} has no comment in conf/quilld.toml's [[engines]] sample"


def test_a_key_added_without_its_description_is_caught():
    """What the test above guards against, shown: a new key with no comment in the sample has no
    description, even under a key that has one (grouped keys share a comment that names them)."""
    text = (ROOT / "conf" / "quilld.toml").read_text().replace("\n[admin]\n", "\nnew_key = 1\n\n[admin]\n", 1)
    described, _ = gen_refs.sample_descriptions(text)
    assert described[("server", "new_key")] == ""
    assert "hedge_max_ms" in described[("cluster", "hedge_max_ms")]  # named in its group's comment


def test_every_flag_sets_a_real_key_and_every_key_flag_is_in_the_table():
    keys = sections()
    for flag in FLAGS:
        assert flag.key in keys[flag.section], flag
    table = {f.name for f in FLAGS}
    parser_flags = {s for a in _parser()._actions for s in a.option_strings if s.startswith("--")}
    assert parser_flags - table == {"--help", "--config", "--log-level", "--version"}


def test_the_sample_names_only_real_flags_and_each_for_its_own_key():
    described, _ = gen_refs.sample_descriptions((ROOT / "conf" / "quilld.toml").read_text())
    flags = {f.name: (f.section, f.key) for f in FLAGS}
    for where, text in described.items():
        for name in re.findall(r"\(flag (--[a-z-]+)", text):
            assert name in flags, f"{where}: conf/quilld.toml names a flag quilld does not have: {name}"
            assert flags[name][0] == where[0], f"{where}: {name} sets {flags[name]}"


def test_every_metric_family_is_on_the_page():
    page = gen_refs.metrics_page()
    families = gen_refs.metric_families()
    assert len(families) > 200
    for name, kind, labels, help_text in families:
        assert name.startswith("quilld_"), name
        assert help_text, f"{name} has no help text"
        assert f"| `{name}` | {kind} |" in page
