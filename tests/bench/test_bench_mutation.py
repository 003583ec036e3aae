"""tools/mutation.py picks the mutants to run from mutmut's records (no mutmut run here)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools import mutation

FILE = "src/grpo/rewards/length.py"
KILLED, SURVIVOR, UNCHECKED = (
    f"grpo.rewards.length.x_soft_overlong__mutmut_{i}" for i in (1, 3, 7)
)


OTHER = "src/grpo/rewards/builtin.py"  # a second file, for runs of some files only


def write_meta(root: Path, codes: dict[str, int | None], path: str = FILE) -> None:
    meta = root / "mutants" / f"{path}.meta"
    meta.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps({"exit_code_by_key": codes}))


def run_main(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    forget: bool,
    first: dict[str, int | None] | None = None,
    outcomes: dict[str, int] | None = None,
    paths: list[str] | None = None,
):
    """main() with a fake mutmut whose first (refresh) call forgets every result when
    ``forget``, mutants/ holding ``first`` at the start (default: one of each kind), and whose
    runs give the mutants named in ``outcomes`` those exit codes (default: a new test kills the
    survivor when it runs alone), over ``paths`` (default: the length file only); returns the
    mutant names of each call."""
    monkeypatch.setattr(mutation, "ROOT", tmp_path)
    monkeypatch.setattr(mutation, "RESULT", tmp_path / "mutation.json")
    monkeypatch.setattr(mutation, "files", lambda: paths or [FILE])
    monkeypatch.setattr(mutation, "head_commit", lambda: "def5678")
    monkeypatch.setattr(mutation, "unmatched_scope", list)  # a fake tree: no sources to read
    write_meta(tmp_path, first or {KILLED: 1, SURVIVOR: 0, UNCHECKED: None})
    calls: list[list[str]] = []

    class Done:
        returncode = 0

    def fake_run(cmd: list[str], cwd: Path) -> Done:
        names = [c for c in cmd if c.startswith("grpo.")]
        calls.append(names)
        if forget and len(calls) == 1:
            write_meta(tmp_path, {KILLED: None, SURVIVOR: None, UNCHECKED: None})
        given = outcomes if outcomes is not None else {SURVIVOR: 1} if names == [SURVIVOR] else {}
        ran = {k: v for k, v in given.items() if k in names}
        if ran:
            write_meta(tmp_path, {**mutation.recorded(FILE), **ran})
        return Done()

    monkeypatch.setattr(mutation.subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["mutation", *argv])
    mutation.main()
    return calls


@pytest.mark.parametrize("forget", [False, True])
def test_survivors_are_rerun_even_when_the_refresh_forgets_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, forget: bool
) -> None:
    calls = run_main(tmp_path, monkeypatch, ["--survivors"], forget)
    assert calls[1] == [SURVIVOR]
    assert ("dropped 2 earlier results" in capsys.readouterr().out) == forget
    # the table keeps the killed mutant the refresh forgot, and the survivor's new result
    (row,) = json.loads((tmp_path / "mutation.json").read_text())["rows"]
    assert (row["checked"], row["killed"], row["survived"]) == (2, 2, 0)
    run = json.loads((tmp_path / "mutation.json").read_text())["runs"][-1]
    assert run["killed_now"] == [SURVIVOR]


def test_resume_runs_only_the_unchecked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = run_main(tmp_path, monkeypatch, ["--resume"], forget=False)
    assert calls[1] == [UNCHECKED]


def test_resume_runs_the_mutants_no_test_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "no tests" (33) when mutmut measured: a test added to the selection since may reach them
    untested = "grpo.rewards.length.x_soft_overlong__mutmut_9"
    first = {KILLED: 1, SURVIVOR: 0, UNCHECKED: None, untested: 33}
    calls = run_main(tmp_path, monkeypatch, ["--resume"], forget=False, first=first)
    assert sorted(calls[1]) == sorted([UNCHECKED, untested])


def test_functions_narrow_a_recheck(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = "grpo.rewards.length.x_other__mutmut_2"
    first = {KILLED: 1, SURVIVOR: 0, other: 0}
    argv = ["--survivors", "--functions", "soft_overlong"]
    calls = run_main(tmp_path, monkeypatch, argv, forget=False, first=first)
    assert calls[1] == [SURVIVOR]
    # the other function's survivor is not run and stays a survivor in the table
    (row,) = json.loads((tmp_path / "mutation.json").read_text())["rows"]
    assert (row["killed"], row["survivors"]) == (2, [other])
    with pytest.raises(SystemExit):
        run_main(tmp_path, monkeypatch, ["--functions", "soft_overlong"], forget=False)


def test_a_whole_run_of_some_files_counts_only_their_mutants(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_meta(tmp_path, {"grpo.rewards.builtin.x_f__mutmut_1": 1}, OTHER)
    argv = ["--files", "rewards/length.py"]
    run_main(tmp_path, monkeypatch, argv, forget=False, paths=[FILE, OTHER])
    # the length file's two checked mutants, not the other file's
    run = json.loads((tmp_path / "mutation.json").read_text())["runs"][-1]
    assert run["mutants"] == 2


def test_a_run_of_some_files_keeps_the_other_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the other file's mutants/ holds only the survivor an earlier re-check ran: not its table
    write_meta(tmp_path, {"grpo.rewards.builtin.x_f__mutmut_1": 0}, OTHER)
    counts = {"mutants": 43, "in_scope": 43, "checked": 43, "killed": 42, "survived": 1}
    row = {"module": "rewards/builtin.py", "commit": "abc1234", **counts, "survivors": ["s"]}
    (tmp_path / "mutation.json").write_text(json.dumps({"rows": [row], "runs": []}))
    argv = ["--survivors", "--files", "rewards/length.py"]
    run_main(tmp_path, monkeypatch, argv, forget=False, paths=[FILE, OTHER])
    rows = json.loads((tmp_path / "mutation.json").read_text())["rows"]
    assert rows[1] == row and rows[0]["module"] == "rewards/length.py"


def test_a_row_with_fewer_results_than_the_results_files_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # mutants/ lost two results the results file had (a refresh after an edit): the new row
    # counts them unchecked, and the console says so in one line
    monkeypatch.setattr(mutation, "ROOT", tmp_path)
    monkeypatch.setattr(mutation, "RESULT", tmp_path / "mutation.json")
    monkeypatch.setattr(mutation, "files", lambda: [FILE])
    counts = {"mutants": 3, "in_scope": 3, "checked": 3, "killed": 2, "survived": 1}
    row = {"module": "rewards/length.py", "commit": "abc1234", **counts, "survivors": [SURVIVOR]}
    (tmp_path / "mutation.json").write_text(json.dumps({"rows": [row], "runs": []}))
    write_meta(tmp_path, {KILLED: 1, SURVIVOR: 0, UNCHECKED: 1})
    assert mutation.table()[0]["checked"] == 3
    assert capsys.readouterr().err == ""
    write_meta(tmp_path, {KILLED: None, SURVIVOR: 0, UNCHECKED: None})
    (new,) = mutation.table()
    assert (new["checked"], new["in_scope"]) == (1, 3)
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "rewards/length.py: 2 mutants without a result" in err and "had 0" in err


def test_a_sample_needs_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        run_main(tmp_path, monkeypatch, ["--sample", "3"], forget=False)


def test_a_fresh_checkout_rechecks_the_survivors_the_results_file_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what a whole run left in the results file; mutants/ is new, so it has no result at all
    row = {"module": "rewards/length.py", "commit": "abc1234", "mutants": 3, "in_scope": 3}
    row |= {"checked": 2, "killed": 1, "survived": 1, "no_tests": 0, "other": 0}
    earlier = {"runs": [{"which": "all"}], "rows": [{**row, "survivors": [SURVIVOR]}]}
    (tmp_path / "mutation.json").write_text(json.dumps(earlier))
    monkeypatch.setattr(mutation, "RESULT", tmp_path / "mutation.json")
    monkeypatch.setattr(
        mutation, "changed_since", lambda path, commit: mutation.Changed([], [], [])
    )
    fresh = dict.fromkeys([KILLED, SURVIVOR, UNCHECKED])
    calls = run_main(tmp_path, monkeypatch, ["--survivors"], forget=False, first=fresh)
    assert calls[1] == [SURVIVOR]
    out = json.loads((tmp_path / "mutation.json").read_text())
    (new,) = out["rows"]
    # the whole run's counts, the survivor now killed; the run's other numbers untouched
    assert (new["checked"], new["killed"], new["survived"], new["survivors"]) == (2, 2, 0, [])
    assert new["commit"] == "def5678" and new["whole_run_at"] == "abc1234"
    assert new["mutants"] == 3
    assert out["runs"][0] == {"which": "all"} and out["runs"][-1]["killed_now"] == [SURVIVOR]


def test_a_function_changed_since_the_recorded_run_is_run_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # recorded: 5 mutants, 4 killed, the survivor in soft_overlong; soft_overlong has changed
    # since, and makes 3 mutants now (2 before): its old names mean other mutations now
    row = {"module": "rewards/length.py", "commit": "abc1234", "mutants": 5, "in_scope": 5}
    row |= {"checked": 5, "killed": 4, "survived": 1, "no_tests": 0, "other": 0}
    earlier = {"runs": [], "rows": [{**row, "survivors": [SURVIVOR]}]}
    (tmp_path / "mutation.json").write_text(json.dumps(earlier))
    monkeypatch.setattr(mutation, "RESULT", tmp_path / "mutation.json")
    changed = mutation.Changed(
        ["x_soft_overlong"], [SURVIVOR, KILLED], [KILLED, SURVIVOR, UNCHECKED], 2, 3
    )
    monkeypatch.setattr(mutation, "changed_since", lambda path, commit: changed)
    fresh = dict.fromkeys([KILLED, SURVIVOR, UNCHECKED])
    outcomes = {KILLED: 1, SURVIVOR: 1, UNCHECKED: 0}
    calls = run_main(tmp_path, monkeypatch, ["--survivors"], False, fresh, outcomes)
    assert calls[1] == [KILLED, SURVIVOR, UNCHECKED]  # the changed function whole
    (new,) = json.loads((tmp_path / "mutation.json").read_text())["rows"]
    # 5 - 2 + 3 in scope; killed: 4 - (2 before, 1 of them the survivor) + 2 now
    assert (new["mutants"], new["in_scope"], new["checked"]) == (6, 6, 6)
    assert (new["killed"], new["survived"]) == (5, 1)
    assert new["survivors"] == [UNCHECKED] and new["changed_since"] == ["x_soft_overlong"]


def test_a_stopped_recheck_keeps_the_unreached_survivors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the results file lists two survivors; the stopped re-check reached one and killed it
    row = {"module": "rewards/length.py", "commit": "abc1234", "mutants": 9, "in_scope": 9}
    row |= {"checked": 9, "killed": 7, "survived": 2, "no_tests": 0, "other": 0}
    earlier = {"runs": [], "rows": [{**row, "survivors": [SURVIVOR, UNCHECKED]}]}
    (tmp_path / "mutation.json").write_text(json.dumps(earlier))
    monkeypatch.setattr(mutation, "RESULT", tmp_path / "mutation.json")
    monkeypatch.setattr(
        mutation, "changed_since", lambda path, commit: mutation.Changed([], [], [])
    )
    reached = {KILLED: None, SURVIVOR: 1, UNCHECKED: None}
    calls = run_main(tmp_path, monkeypatch, ["--rechecked"], False, reached)
    assert calls == []  # nothing is run
    out = json.loads((tmp_path / "mutation.json").read_text())
    (new,) = out["rows"]
    assert (new["checked"], new["killed"], new["survived"]) == (9, 8, 1)
    assert new["survivors"] == [UNCHECKED]
    assert out["runs"][-1] == {
        "which": "survivors, stopped",
        "commit": "def5678",
        "mutants": 2,
        "checked": 1,
        "killed_now": [SURVIVOR],
    }


def test_docs_explain_every_survivor_the_results_file_lists() -> None:
    rows = json.loads(mutation.RESULT.read_text())["rows"]
    page = (mutation.ROOT / "docs" / "testing.md").read_text()  # "Mutation testing"
    missing, stale = mutation.unexplained(rows, page)
    assert (missing, stale) == ([], [])


def test_the_survivor_list_reads_names_numbers_ranges_and_bare_methods() -> None:
    readme = (
        f"{mutation.EXPLAINED_FROM}\n- **A class** (`device=None`): `pack` 3, 5-7 (and 9, equal"
        " here); `History.owners` 8 (a remark: 40), 10; `run_calls` 11.\n## Next section `f` 1"
    )
    functions = {"x_pack", "xǁHistoryǁowners", "xǁMultiTurnEngineǁrun_calls"}
    assert mutation.explained(readme, functions) == {
        *(f"x_pack__mutmut_{n}" for n in (3, 5, 6, 7, 9)),
        "xǁHistoryǁowners__mutmut_8",
        "xǁHistoryǁowners__mutmut_10",
        "xǁMultiTurnEngineǁrun_calls__mutmut_11",
    }


def test_a_readme_without_the_list_explains_nothing() -> None:
    rows = [{"survivors": ["grpo.rewards.length.x_soft_overlong__mutmut_3"]}]
    assert mutation.unexplained(rows, "# README without it") == (
        ["x_soft_overlong__mutmut_3"],
        [],
    )


def test_a_test_map_of_other_sources_is_stale(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True)
        return out.stdout.strip()

    source = tmp_path / FILE
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    return 1\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    stats = tmp_path / "mutants" / "mutmut-stats.json"
    assert not mutation.stale_test_map(tmp_path)  # no record: mutmut measures everything
    stats.parent.mkdir()
    stats.write_text(json.dumps({"git_commit": git("rev-parse", "HEAD")}))
    assert not mutation.stale_test_map(tmp_path)
    source.write_text("def f():\n    return _g()\n\n\ndef _g():\n    return 1\n")
    assert mutation.stale_test_map(tmp_path)  # the working tree moved on
    source.write_text("def f():\n    return 1\n")
    assert not mutation.stale_test_map(tmp_path)
    (source.parent / "new.py").write_text("def h():\n    return 2\n")
    assert mutation.stale_test_map(tmp_path)  # a new file git does not track yet
    (source.parent / "new.py").unlink()
    stats.write_text(json.dumps({"git_commit": "0" * 40}))
    source.write_text("def f():\n    return 1\n")
    assert mutation.stale_test_map(tmp_path)  # a commit this clone does not have
    for damaged in ('{"git_commit": "ab', "[]"):  # cut off mid-write; not mutmut's record
        stats.write_text(damaged)
        assert mutation.stale_test_map(tmp_path)


def test_a_resume_measures_the_suite_again_over_a_stale_test_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    stats = tmp_path / "mutants" / "mutmut-stats.json"
    stats.parent.mkdir(parents=True)
    stats.write_text("{}")
    monkeypatch.setattr(mutation, "stale_test_map", lambda root: root == tmp_path)
    run_main(tmp_path, monkeypatch, ["--resume"], forget=False)
    assert not stats.exists()
    assert "measured again" in capsys.readouterr().out


def test_compare_counts_only_functions_of_the_same_source_in_rows_checked_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: a whole-file row of an older path (the file moved since); f kept its source, g
    # changed, h is gone. f had 1 survivor of its mutants then, and has 2 now. k kept its
    # source too, but its row was a sample: which of its mutants were checked is not recorded
    f_src = "def f(a, b):\n    return a + b if a > 1 else a - b\n"
    k_src = "def k(z):\n    return z * 5 - 2\n"
    old_src = f_src + "def g(x):\n    return x * 2\n" + "def h(y):\n    return y - 1\n"
    new_src = f_src + "def g(x):\n    return x * 3 + 1\n" + k_src
    path = "src/grpo/rewards/length.py"
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(new_src)
    f_mutants = [
        n for n in mutation.mutate_file_contents(path, f_src).mutant_names if n.startswith("x_f_")
    ]
    old_row = {
        "module": "old/place.py",
        "commit": "abc",
        "mutants": 10,
        "in_scope": 10,
        "checked": 10,
        "survivors": [f"grpo.old.place.{f_mutants[0]}"],
    }
    narrowed = {**old_row, "module": "other.py", "in_scope": 3, "checked": 3, "survivors": []}
    sampled = {**old_row, "module": "sampled.py", "checked": 4, "survivors": []}
    shown = {
        ("ref", "benchmarks/results/mutation.json"): json.dumps(
            {"rows": [old_row, narrowed, sampled]}
        ),
        ("abc", "src/grpo/old/place.py"): old_src,
        ("abc", "src/grpo/sampled.py"): k_src,
    }
    monkeypatch.setattr(mutation, "ROOT", tmp_path)
    monkeypatch.setattr(mutation, "RESULT", tmp_path / "benchmarks" / "results" / "mutation.json")
    monkeypatch.setattr(mutation, "_git_show", lambda ref, p: shown[(ref, p)])
    monkeypatch.setattr(mutation, "files", lambda: [path])
    codes = {f"grpo.rewards.length.{n}": 1 for n in f_mutants}
    codes[f"grpo.rewards.length.{f_mutants[0]}"] = 0
    codes[f"grpo.rewards.length.{f_mutants[1]}"] = 0
    codes["grpo.rewards.length.x_g__mutmut_1"] = 0
    codes["grpo.rewards.length.x_k__mutmut_1"] = 1
    write_meta(tmp_path, codes)
    n = len(f_mutants)
    assert mutation.compare("ref") == {
        "before": {"checked": n, "killed": n - 1},
        "now": {"checked": n, "killed": n - 2},
        "functions": 1,
        "left_out": ["other.py", "sampled.py"],
    }


@pytest.fixture(scope="module")
def parsed_once():
    """mutmut's mutated functions of each source found once for the module's scope checks
    (libcst takes seconds for the trainer alone): the same result for the same path and text."""
    find = mutation.function_hashes
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mutation, "function_hashes", functools.cache(find))
        yield


def test_function_hashes_are_mutmuts_own() -> None:
    # built from mutmut's private parts: a mutmut that changes them shows here first
    path = "src/grpo/rewards/registry.py"
    code = (mutation.ROOT / path).read_text()
    found = mutation.function_hashes(path, code)
    assert found == mutation.mutate_file_contents(path, code).hash_by_function_name
    assert "x_resolve_reward" in found and len(found) > 3


@pytest.mark.usefixtures("parsed_once")
def test_every_scope_name_is_a_function_of_a_mutated_file() -> None:
    # a function moved or renamed leaves its old name in SCOPE matching nothing: its mutants
    # would leave the run without a word
    assert mutation.unmatched_scope() == []


@pytest.mark.usefixtures("parsed_once")
def test_a_scope_name_that_matches_nothing_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    scope = {**mutation.SCOPE, "src/grpo/training/trainer.py": ["Trainer.gone", "Trainer.optimize"]}
    monkeypatch.setattr(mutation, "SCOPE", scope)
    assert mutation.unmatched_scope() == ["src/grpo/training/trainer.py: Trainer.gone"]
    monkeypatch.setattr(mutation, "SCOPE", {"src/grpo/training/critic.py": ["value_model"]})
    assert mutation.unmatched_scope() == ["src/grpo/training/critic.py: not in only_mutate"]
    # a file moved away altogether is named too, not a traceback
    monkeypatch.setattr(mutation, "files", lambda: ["src/grpo/gone.py"])
    monkeypatch.setattr(mutation, "SCOPE", {"src/grpo/gone.py": ["f"]})
    assert mutation.unmatched_scope() == ["src/grpo/gone.py: no such file"]
