"""`kvjax run`: configs validate, every shipped experiment's smoke variant runs end to end and
writes its results folder, runs are deterministic, bad input fails before any work, and an
interrupted sweep resumes."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest

from kvjax.cli import main
from kvjax.config import ConfigError
from kvjax.config_files import load_config
from kvjax.lab import registry as experiments
from kvjax.lab import results, runner
from kvjax.lab.results import deterministic

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
EXPERIMENT_CONFIGS = [c for c in CONFIGS if "experiment" in tomllib.loads(c.read_text())]


def _quiet(*_args) -> None:
    return None


def test_every_config_parses_and_validates():
    assert len(EXPERIMENT_CONFIGS) >= 8
    for path in CONFIGS:
        if path in EXPERIMENT_CONFIGS:
            for overrides in ([], ["scale=small"]):
                exp = runner.resolve(path, overrides)
                assert exp.points, path
        else:
            load_config(path)


def test_every_shipped_experiment_has_a_config_and_a_description():
    names = {tomllib.loads(c.read_text())["experiment"] for c in EXPERIMENT_CONFIGS}
    assert set(experiments.shipped()) <= names
    for name in experiments.shipped():
        assert experiments.describe(experiments.load(name))


def test_list_names_every_experiment(capsys):
    assert main(["run", "--list"]) == 0
    out = capsys.readouterr().out
    for name in experiments.shipped():
        assert name in out


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory) -> Path:
    """One folder for the tiny trained pair the spec and tour smoke runs share."""
    return tmp_path_factory.mktemp("pair")


def _smoke_overrides(name: str, pair: Path) -> list[str]:
    train = [f'params.target_train="{ROOT / "configs/train_tiny_target.toml"}"',
             f'params.draft_train="{ROOT / "configs/train_tiny_draft.toml"}"']
    extra = {
        "spec_operating_point": [f'params.target_dir="{pair / "target"}"',
                                 f'params.draft_dir="{pair / "draft"}"', *train],
        "tour": [f'params.short_dir="{pair}"', *train],
    }
    return ["scale=small", *extra.get(name, [])]


def _read(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _check_folder(out: Path, exp) -> list[dict]:
    rows = _read(out)
    assert rows
    assert json.loads((out / "config.json").read_text()) == exp.resolved()
    env = json.loads((out / "environment.json").read_text())
    assert env["versions"]["jax"] and env["versions"]["kvjax"] and env["device"]
    assert "commit" in env["git"]
    with open(out / "metrics.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    pngs = list(out.glob("*.png"))
    assert pngs
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 5000
    summary = (out / "summary.md").read_text()
    assert "| " in summary and "Reproduce: `kvjax run" in summary
    for png in pngs:
        assert f"]({png.name})" in summary
    return rows


SMOKE = ["prefix_page_size", "partial_copy", "eviction", "scheduling", "identity",
         "kv_memory", "kv_tiers", "spec_operating_point", "tour"]
# the real model's experiments run their smoke variants in test_real_model.py, beside the
# other checks of the real model (one process compiles the 30-layer model's steps once)
ELSEWHERE = ["chat", "mtbench_spec", "sharegpt_reuse"]


def test_smoke_list_is_every_shipped_experiment():
    assert sorted(SMOKE + ELSEWHERE) == experiments.shipped()


@pytest.mark.slow
@pytest.mark.parametrize("name", SMOKE)
def test_smoke_variant_runs_end_to_end(name, tmp_path, pair_dir, capsys):
    config = ROOT / "configs" / f"{name}.toml"
    overrides = _smoke_overrides(name, pair_dir)
    args = ["run", str(config), "--out", str(tmp_path / "out")]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 0
    assert f"results: {tmp_path / 'out'}" in capsys.readouterr().out
    exp = runner.resolve(config, overrides)
    rows = _check_folder(tmp_path / "out", exp)
    CHECKS[name](rows)
    # Same config, same seed: the first point again gives the same metrics but timings.
    first = exp.points[0][0]
    fixed = [f"{k}={json.dumps(v)}" for k, v in first.items()]
    again = runner.run(runner.resolve(config, overrides + fixed), tmp_path / "again",
                       echo=_quiet)
    expected = [r for r in rows if all(r[k] == v for k, v in first.items())]
    assert deterministic(_read(again), exp.module) == deterministic(expected, exp.module)


def _prefix(rows):
    for w in {r["workload"] for r in rows}:
        rs = [r for r in rows if r["workload"] == w]
        assert len({r["tokens_digest"] for r in rs}) == 1  # same outputs at every page size
        assert max(r["token_reuse_rate"] for r in rs) > 0.3
        small, large = min(rs, key=lambda r: r["page_size"]), max(rs, key=lambda r: r["page_size"])
        assert small["reused_tokens"] >= large["reused_tokens"]


def _partial(rows):
    for r in rows:
        assert r["same_tokens"]
        assert r["max_logit_diff_on"] == 0 and r["max_logit_diff_off"] == 0  # bitwise
        assert r["reused_tokens_on"] >= r["reused_tokens_off"]
    assert all(r["tokens_gained"] > 0 and r["partial_copies"] > 0 for r in rows
               if r["workload"] != "multi_turn")
    assert any(r["workload"] == "multi_turn" for r in rows)


def _eviction(rows):
    assert len({r["tokens_digest"] for r in rows}) == 1
    for r in rows:
        assert r["token_reuse_rate"] <= r["ceiling_token_reuse_rate"] + 1e-12
        if r["capacity"] >= 1.0:
            assert r["fraction_of_ceiling"] == pytest.approx(1.0, rel=1e-12)  # measured 0
            assert r["misses_capacity"] == 0
    tight = [r for r in rows if r["capacity"] < 0.5]
    assert tight and all(r["misses_capacity"] > 0 and r["evictions"] > 0 for r in tight)


def _scheduling(rows):
    assert len({r["tokens_digest"] for r in rows}) == 1
    by = {(r["schedule"], r["capacity"]): r for r in rows}
    for cap in {r["capacity"] for r in rows}:
        assert by["lpm", cap]["computed_tokens"] <= by["fcfs", cap]["computed_tokens"]


def _identity(rows):
    by = {r["field"]: r for r in rows}
    assert set(by) == {"adapter", "position_base", "salt", "model", "kv_dtype"}
    for field in ("adapter", "position_base", "model", "kv_dtype"):
        assert by[field]["outputs_would_change"], field
    assert by["salt"]["max_logit_diff"] == 0 and by["salt"]["changed_outputs"] == 0
    for field in ("adapter", "position_base", "salt", "model"):
        assert by[field]["reuse_lost"] > 0 and by[field]["namespace_misses"] >= 1


def _kv_memory(rows):
    for r in rows:
        assert r["calculator_matches"]
        assert r["decode_ms_per_token"] > 0
        assert (r["max_logit_diff_vs_f32"] > 0) == (r["cache_dtype"] != "float32")
    by = {r["attention"]: r["bytes_per_token_measured"] for r in rows}
    assert by["mha"] > by["mqa"]


def _kv_tiers(rows):
    """The smoke sweep: int8 pages, a restart half way, no tiers vs host + disk."""
    for r in rows:
        assert r["same_as_cache_off"]  # bitwise, in its own format
        assert r["max_logit_diff_vs_f32"] > 0  # int8 pages: not float32's numbers
        assert r["reused_tokens"] == r["reused_device"] + r["reused_host"] + r["reused_disk"]
    by = {r["tiers"]: r for r in rows}
    assert by["none"]["reused_host"] == by["none"]["reused_disk"] == 0
    assert by["host+disk"]["reused_disk"] > 0  # the restarted engine read the disk
    assert by["host+disk"]["fraction_of_ceiling"] > by["none"]["fraction_of_ceiling"]


def _spec(rows):
    assert {r["drafter"] for r in rows} == {"model", "ngram"}
    for r in rows:
        assert r["same"] == r["prompts"]  # greedy: identical to plain decoding
        assert 0 <= r["alpha"] <= 1 and r["speedup"] > 0


def _tour(rows):
    prefix = [r for r in rows if "reused_tokens" in r]
    assert all(r["same_as_cache_off"] for r in prefix)
    causes = {r["miss_cause"] for r in prefix}
    assert {"cold", "divergence", "namespace", "capacity"} <= causes
    spec = [r for r in rows if "speedup" in r]
    assert len(spec) == 2 and all(r["same_as_plain"] for r in spec)


CHECKS = {"prefix_page_size": _prefix, "partial_copy": _partial, "eviction": _eviction,
          "scheduling": _scheduling, "identity": _identity, "kv_memory": _kv_memory,
          "kv_tiers": _kv_tiers,
          "spec_operating_point": _spec, "tour": _tour}


# -- bad input: a clear error before any work ----------------------------------------------


@pytest.fixture
def no_work(monkeypatch):
    """Makes any experiment's `run` fail the test."""
    def refuse(_config):
        raise AssertionError("work started")

    for name in experiments.shipped():
        monkeypatch.setattr(experiments.load(name), "run", refuse)


@pytest.mark.parametrize(("overrides", "message"), [
    (["experiment=nope"], "experiment: unknown experiment 'nope'"),
    (["params.nope=1"], "params.nope: unknown key (known: capacity_tokens"),
    (["nope=1"], "nope: unknown key for --set"),
    (["sweep.nope=[1, 2]"], "sweep.nope: not a parameter"),
    (["sweep.page_size=[4, 0]"], "sweep.page_size: at sweep point"),
    (["sweep.workload=['system_prompt', 'chat']"], "sweep.workload: at sweep point"),
    (["sweep.page_size=[4, 'x']"], "sweep.page_size: expected an integer"),
    (["params.requests=0"], "params.requests: must be >= 1"),
    (["scale=tiny"], "scale: 'tiny' is not one of"),
    (["mesh=pipe=2"], "mesh: 'pipe=2': unknown axis 'pipe'"),
    (["mesh=data=128,model=128"], "mesh: 'data=128,model=128' needs 16384 devices"),
    (["experiment=kv_memory", "mesh=model=2"], "mesh: 'kv_memory' does not run on a mesh"),
])
def test_bad_config_is_a_clear_error_before_any_work(overrides, message, tmp_path, no_work,
                                                     capsys):
    _refused("prefix_page_size", overrides, message, tmp_path, capsys)


def _refused(config: str, overrides: list[str], message: str, tmp_path, capsys) -> None:
    """`kvjax run configs/<config>.toml --set ...` exits 2 naming `message`, writing nothing."""
    args = ["run", str(ROOT / "configs" / f"{config}.toml"), "--out", str(tmp_path / "o")]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_adaptive_mtbench_points_need_trees(tmp_path, no_work, capsys):
    _refused("mtbench_spec", ["params.adaptive=true"],
             "params.adaptive: adaptive widths are for trees", tmp_path, capsys)


def test_unknown_experiment_in_a_config_file(tmp_path, no_work):
    config = tmp_path / "x.toml"
    config.write_text('experiment = "not_an_experiment"\n')
    with pytest.raises(ConfigError, match="unknown experiment 'not_an_experiment'"):
        runner.resolve(config)
    config.write_text('experiment = "eviction"\n[sweep]\neviction = ["lru", "random"]\n')
    with pytest.raises(ConfigError, match="sweep.eviction: at sweep point.*'random'"):
        runner.resolve(config)
    config.write_text('experiment = "eviction"\nextra = 1\n')
    with pytest.raises(ConfigError, match="extra: unknown top-level key"):
        runner.resolve(config)


def test_a_folder_of_another_config_is_not_overwritten(tmp_path, no_work):
    config = ROOT / "configs/prefix_page_size.toml"
    out = tmp_path / "o"
    results.start(out, runner.resolve(config, ["scale=small"]).resolved(), fresh=False)
    other = runner.resolve(config, ["scale=small", "seed=1"])
    with pytest.raises(ConfigError, match="holds results of a different config"):
        runner.run(other, out, echo=_quiet)
    assert json.loads((out / "config.json").read_text())["seed"] == 0


# -- determinism and resume ----------------------------------------------------------------


class _Interrupt(Exception):
    pass


def test_resume_skips_finished_points_and_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    config = ROOT / "configs/eviction.toml"
    exp = runner.resolve(config, ["scale=small"])
    assert len(exp.points) == 4
    module = exp.module
    original = module.run
    whole = runner.run(exp, tmp_path / "whole", echo=_quiet)

    calls = []

    def interrupted(point_config):
        if len(calls) == 2:
            raise _Interrupt  # as a Ctrl-C or a crash in the third point would
        calls.append(point_config.point)
        return original(point_config)

    monkeypatch.setattr(module, "run", interrupted)
    with pytest.raises(_Interrupt):
        runner.run(exp, tmp_path / "resumed", echo=_quiet)
    assert len((tmp_path / "resumed" / "points.jsonl").read_text().splitlines()) == 2
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()

    resumed_calls = []

    def counting(point_config):
        resumed_calls.append(point_config.point)
        return original(point_config)

    monkeypatch.setattr(module, "run", counting)
    messages = []
    runner.run(exp, tmp_path / "resumed", echo=messages.append)
    assert messages[0].startswith(f"resuming {tmp_path / 'resumed'}: 2 of 4 points")
    assert resumed_calls == [p for p, _ in exp.points[2:]]
    # Same seed, same config: identical metrics apart from timings (a rerun and a resume).
    assert deterministic(_read(whole), module) == deterministic(_read(tmp_path / "resumed"),
                                                                module)
    assert [r["capacity"] for r in _read(whole)] == [p["capacity"] for p, _ in exp.points]
    # The journal records each point's commit; the resumed run appended its own environment
    # under `resumes`, after the first run's (kept as it was).
    env = json.loads((tmp_path / "resumed" / "environment.json").read_text())
    journal = [json.loads(line) for line in
               (tmp_path / "resumed" / "points.jsonl").read_text().splitlines()]
    assert [j["point"] for j in journal] == [p for p, _ in exp.points]
    assert env["git"]["commit"] and {j["commit"] for j in journal} == {env["git"]["commit"]}
    assert len(env["resumes"]) == 1
    assert env["resumes"][0]["git"] == env["git"] and "resumes" not in env["resumes"][0]
    assert json.loads((tmp_path / "whole" / "environment.json").read_text())["resumes"] == []


def test_a_torn_journal_line_is_redone(tmp_path):
    config = ROOT / "configs/partial_copy.toml"
    exp = runner.resolve(config, ["scale=small"])
    out = runner.run(exp, tmp_path / "o", echo=_quiet)
    first = _read(out)
    journal = out / "points.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # crash mid-write
    runner.run(exp, out, echo=_quiet)
    assert deterministic(_read(out), exp.module) == deterministic(first, exp.module)


def test_same_seed_same_metrics_other_seed_other_workload(tmp_path):
    config = ROOT / "configs/prefix_page_size.toml"
    small = ["scale=small", "sweep.page_size=[16]"]
    a = runner.run(runner.resolve(config, small), tmp_path / "a", echo=_quiet)
    b = runner.run(runner.resolve(config, small), tmp_path / "b", echo=_quiet)
    c = runner.run(runner.resolve(config, [*small, "seed=1"]), tmp_path / "c", echo=_quiet)
    module = experiments.load("prefix_page_size")
    assert deterministic(_read(a), module) == deterministic(_read(b), module)
    assert deterministic(_read(a), module) != deterministic(_read(c), module)


def test_set_fixes_a_swept_field_and_sweep_overrides_replace_lists():
    config = ROOT / "configs/prefix_page_size.toml"
    exp = runner.resolve(config, ["page_size=16"])
    assert "page_size" not in exp.sweep and exp.params.page_size == 16
    assert len(exp.points) == 3
    exp = runner.resolve(config, ["scale=small", "sweep.page_size=[1, 64]", "params.slots=2"])
    assert exp.sweep["page_size"] == [1, 64] and exp.params.slots == 2
    assert exp.params.model == "tiny"  # the small table still applies


def test_a_researchers_own_experiment_module_runs_from_the_working_directory(tmp_path,
                                                                               monkeypatch):
    (tmp_path / "my_lab").mkdir()
    (tmp_path / "my_lab" / "__init__.py").write_text("")
    (tmp_path / "my_lab" / "square.py").write_text('''"""Squares a number."""
import dataclasses

from kvjax.config import ConfigError
from experiments import common


@dataclasses.dataclass(frozen=True)
class Params:
    x: int = 1

    def __post_init__(self):
        if self.x < 0:
            raise ConfigError("x", "must be >= 0")


def run(config):
    return {"square": config.params.x ** 2, "seed": config.seed}


COLUMNS = [("x", lambda r: str(r["x"])), ("x²", lambda r: str(r["square"]))]


def plot(rows, out):
    plt, fig, ax = common.figure()
    ax.plot([r["x"] for r in rows], [r["square"] for r in rows], "o-")
    return [common.save(plt, fig, out, "square.png")]
''')
    config = tmp_path / "square.toml"
    config.write_text('experiment = "my_lab.square"\nseed = 3\n[sweep]\nx = [1, 2, 3]\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"sweep.x: at sweep point \{'x': -1\}"):
        runner.resolve(config, ["sweep.x=[1, -1]"])
    out = runner.run(runner.resolve(config), echo=_quiet)
    assert out == Path("results/square")
    assert [(r["x"], r["square"], r["seed"]) for r in _read(out)] == [(1, 1, 3), (2, 4, 3),
                                                                      (3, 9, 3)]
    assert "| 3 | 9 |" in (out / "summary.md").read_text()


def test_kvjax_run_works_from_any_directory_inside_the_clone(tmp_path, monkeypatch, capsys):
    """From a subfolder the shipped experiment is found and the config's paths are the
    clone's (the command runs as from the root); paths typed on the command line are taken
    from where they were typed."""
    monkeypatch.chdir(ROOT / "docs")
    out = tmp_path / "out"
    typed = os.path.relpath(out, ROOT / "docs")  # relative to where it is typed
    assert main(["run", "../configs/prefix_page_size.toml", "--set", "scale=small",
                 "--set", 'sweep.workload=["few_shot"]', "--set", "sweep.page_size=[16]",
                 "--out", typed]) == 0
    assert Path.cwd() == ROOT
    assert _read(out) and "prefix_page_size" in capsys.readouterr().out


@pytest.mark.parametrize(("after", "dropped"), [(35_000, True), (33_000, False), (12_000, False)])
def test_a_sweep_drops_compiled_code_when_its_next_point_might_pass_the_map_limit(
        tmp_path, monkeypatch, after, dropped):
    """XLA:CPU holds memory maps per compiled program: after each point the runner drops
    them if the maps held plus the most one point has added could pass 90% of the kernel's
    limit (a 9-point SmolLM2 sweep crossed it and the compiler failed); otherwise every
    point's programs stay for the next. Each point here starts at 10,000 maps: ending at
    35,000 (25,000 added) could pass 58,977, at 33,000 not."""
    package = f"lab_{after}"  # a module of its own for each case
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "compiles.py").write_text('''"""Compiles one program per point."""
import dataclasses

import jax
import jax.numpy as jnp

PROGRAMS = []


@dataclasses.dataclass(frozen=True)
class Params:
    x: int = 1


def run(config):
    f = jax.jit(lambda a: a * config.params.x)
    PROGRAMS.append(f)
    return {"y": float(f(jnp.ones(2))[0])}


COLUMNS = [("x", lambda r: str(r["x"]))]


def plot(rows, out):
    return []
''')
    config = tmp_path / "compiles.toml"
    config.write_text(f'experiment = "{package}.compiles"\n[sweep]\nx = [2, 3]\n')
    monkeypatch.chdir(tmp_path)
    real = runner.memory_maps()
    assert real is None or 0 < real[0] < real[1]  # Linux: /proc tells both; else None
    counts = iter([10_000, after] * 2)  # before and after each point
    monkeypatch.setattr(runner, "memory_maps", lambda: (next(counts), 65_530))
    out = runner.run(runner.resolve(config), echo=_quiet)
    assert [r["y"] for r in _read(out)] == [2.0, 3.0]
    programs = sys.modules[f"{package}.compiles"].PROGRAMS
    assert [f._cache_size() for f in programs] == ([0, 0] if dropped else [1, 1])


def test_sharegpt_reuse_sums_the_metrics_of_every_engine_a_restart_used():
    """A restart brings in a second engine: the row's misses, reuse by tier, evictions,
    preemptions and restore seconds are both engines' sums (an engine without tiers counts
    its reuse as the device's)."""
    from experiments.sharegpt_reuse import _summed

    first = {"misses_by_cause": {"cold": 3, "capacity": 1}, "reused_tokens": 40,
             "evictions": 2, "preemptions": 1, "tiers": None}
    second = {"misses_by_cause": {"cold": 1}, "reused_tokens": 70, "evictions": 5,
              "preemptions": 0, "tiers": {"reused_tokens": {"device": 30, "disk": 40},
                                          "restore_s": 0.5}}
    m = _summed([first, second])
    assert m["misses_by_cause"] == {"cold": 4, "capacity": 1}
    assert m["by_tier"] == {"device": 70, "disk": 40}
    assert (m["evictions"], m["preemptions"], m["restore_s"]) == (7, 1, 0.5)


@pytest.mark.parametrize(("overrides", "message"), [
    (["params.drafter=eagle", "params.tree_nodes=8"], "params.head: the eagle drafter needs"),
    (["params.head=/nowhere"], "params.head: the eagle drafter needs"),
    (["params.drafter=eagle", "params.head=/nowhere"], "params.tree_nodes"),
    (["params.drafter=model"], "params.drafter: 'model' is not one of"),
    (["params.tree_nodes=8", "params.rerank=true"], "params.rerank: for EAGLE trees"),
    (["params.drafter=eagle", "params.head=/nowhere", "params.tree_nodes=8",
      "params.rerank=true", "params.adaptive=true"], "params.rerank: for EAGLE trees of a"),
    (["params.temperature=-0.5"], "params.temperature: -0.5: 0 (greedy) or more")])
def test_eagle_mtbench_points_need_a_head_and_trees(tmp_path, no_work, capsys, overrides,
                                                    message):
    _refused("mtbench_spec", overrides, message, tmp_path, capsys)
