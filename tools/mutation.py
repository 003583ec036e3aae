"""``make mutate``: mutation testing with mutmut over the math, the log-probs, the rollout and
reward logic and the trainer's wiring, then the table docs/results/mutation.md shows.

The files are ``only_mutate`` in ``[tool.mutmut]`` (pyproject.toml); ``SCOPE`` below narrows a
file to the functions that are in scope, and says why the rest is not. mutmut runs each mutant
against only the tests that reached its function while it measured the suite once, so a mutant
costs its function's tests, not the whole selection. Writes benchmarks/results/mutation.json.

Run: .venv/bin/python -m tools.mutation [--max-children N]   (the whole run)
     .venv/bin/python -m tools.mutation --resume   (only what is unchecked, e.g. after an
                                                         edit or a stopped run)
     .venv/bin/python -m tools.mutation --resume --files logprobs.py rewards/*.py
                                                        (some files only)
     .venv/bin/python -m tools.mutation --resume --sample 400
                                                        (a seeded random sample of the unchecked
                                                         ones: an unbiased kill rate when the
                                                         whole run does not fit the time)
     .venv/bin/python -m tools.mutation --survivors  (re-check the survivors, e.g. after
                                                         adding tests for them)
     .venv/bin/python -m tools.mutation --survivors --files scoring/packing.py \
         --functions attention_dropout_on                 (the survivors of some functions
                                                         only, e.g. after a test for them)
     .venv/bin/python -m tools.mutation --table      (the results file's table and its
                                                         survivors; writes nothing)
     .venv/bin/python -m tools.mutation --compare REF  (mutants/'s kill rate against the
                                                         results file at a git ref, same
                                                         functions; writes nothing)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import fnmatch
import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import tomllib
from mutmut.mutation.file_mutation import (
    _compute_mutated_function_hashes,
    create_mutations,
    mutate_file_contents,
)

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "mutation.json"

# file -> the functions in scope ("Class.method" or "function"); files not named here are in
# scope whole. What is left out runs processes, touches the disk or builds models: its tests
# take seconds each, and it holds no formula or config wiring.
SCOPE: dict[str, list[str]] = {
    # the trainer's update and reference refresh. Left out: model and run-directory set-up,
    # checkpoints, signals, the loop, held-out eval, metric bookkeeping
    "src/grpo/training/trainer.py": ["Trainer.optimize", "Trainer.refresh_reference"],
    # the update's wiring: knobs, log-probs, loss, optimizer steps. Left out: the constructor
    "src/grpo/training/update.py": [
        "loss_knobs",
        "_rows",
        "PolicyUpdate.logprobs",
        "PolicyUpdate.frozen_logprobs",
        "PolicyUpdate.prepare",
        "PolicyUpdate.micro_batch_loss",
        "PolicyUpdate.accumulate",
        "PolicyUpdate.optimizer_step",
        "PolicyUpdate.__call__",
    ],
    # config -> rollout, rewards, advantages, dynamic sampling's rounds. Left out: the engine's
    # release and the state's round trip (the checkpoint tests)
    "src/grpo/training/producer.py": [
        "InProcessProducer.rollout",
        "InProcessProducer.score",
        "InProcessProducer.recomputed_advantages",
        "InProcessProducer.sample",
        "InProcessProducer.collect",
    ],
    # left out: the math-verify worker processes (MathVerifier)
    "src/grpo/rewards/accuracy.py": [
        "_*",
        "extract_answer",
        "normalise",
        "as_number",
        "equivalent_in_process",
        "answers_match",
        "AccuracyReward.*",
    ],
    # left out: the runs in the sandbox (passed_io_cases, passed_tests)
    "src/grpo/rewards/code.py": ["extract_code", "with_prefix", "normalise_output", "_as_tests"],
    # left out: the worker pool of user functions (RewardRunner.__init__, close)
    "src/grpo/rewards/runner.py": [
        "function_name",
        "weighted_total",
        "RewardRunner.__call__",
        "RewardRunner._fail",
        "RewardRunner._report",
        "RewardRunner._store",
        "ErrorWatch.*",
    ],
    # left out: the lazy import of the built-ins (the registry's loading)
    "src/grpo/rewards/registry.py": ["resolve_reward"],
    # left out: the Python tool's run in the sandbox (PythonTool)
    "src/grpo/rollout/tools.py": ["notebook_source", "last_error_line"],
}


def function_hashes(path: str, code: str) -> dict[str, str]:
    """mutmut's ``hash_by_function_name`` of ``code`` (the functions it makes mutants of, by
    mangled name) without writing out every mutant's source: a fifth of the time of
    ``mutate_file_contents``, whose result is built by the same two calls."""
    module, mutations, _, _ = create_mutations(path, code)
    return _compute_mutated_function_hashes(code, module, mutations)


def unmatched_scope() -> list[str]:
    """``SCOPE`` names that match no function of their file (a function moved or renamed), and
    files of ``SCOPE`` mutmut does not mutate: either drops code from the run without a word, as
    when the trainer's update moved to ``training/update.py`` and the trainer's row fell from
    657 mutants in scope to 14."""
    missing = [f"{path}: not in only_mutate" for path in SCOPE if path not in files()]
    for path, names in SCOPE.items():
        if not (ROOT / path).is_file():
            missing.append(f"{path}: no such file")
            continue
        functions = function_hashes(path, (ROOT / path).read_text())
        for name in names:
            pattern = mangled("", name).removeprefix(".").removesuffix("__mutmut_*")
            if not fnmatch.filter(functions, pattern):
                missing.append(f"{path}: {name}")
    return missing


def mangled(module: str, function: str) -> str:
    """mutmut's name for a function's mutants: grpo.m.x_f__mutmut_N, grpo.m.xǁCǁf__mutmut_N."""
    cls, _, name = function.rpartition(".")
    return f"{module}.x{'ǁ' + cls + 'ǁ' if cls else '_'}{name}__mutmut_*"


def module_of(path: str) -> str:
    parts = Path(path).with_suffix("").parts[1:]  # src/grpo/x/y.py -> grpo.x.y
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def files() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    return config["only_mutate"]


def patterns() -> dict[str, list[str]]:
    """file -> mutant-name patterns of what is in scope."""
    return {
        path: [mangled(module_of(path), f) for f in SCOPE.get(path, ["*"])]
        if path in SCOPE
        else [f"{module_of(path)}.x*"]
        for path in files()
    }


NO_TESTS = 33  # mutmut's exit code for a mutant whose function no selected test reaches
STATUS = {1: "killed", 3: "killed", 0: "survived", None: "not checked", NO_TESTS: "no tests"}


def recorded(path: str) -> dict[str, int | None]:
    """mutant -> mutmut's exit code (None: not checked) of every mutant of a file."""
    meta = ROOT / "mutants" / f"{path}.meta"
    return json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}


def in_scope(path: str, codes: dict[str, int | None]) -> dict[str, int | None]:
    return {k: v for k, v in codes.items() if any(fnmatch.fnmatch(k, p) for p in patterns()[path])}


def results(path: str) -> dict[str, int | None]:
    """mutant -> mutmut's exit code (None: not checked) of the in-scope mutants of a file."""
    return in_scope(path, recorded(path))


def head_commit() -> str:
    """The commit the mutants are made from (recorded with every row and run)."""
    git = ["git", "rev-parse", "--short", "HEAD"]
    return subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def stale_test_map(root: Path) -> bool:
    """Whether mutmut's record of which tests reach each function (``mutants/mutmut-stats.json``)
    was measured on other sources than the working tree's. mutmut then re-measures only some
    tests, which can map a new function to fewer tests than reach it: after adec2db moved
    ``MultiTurnEngine.generate``'s body into ``_generate``, the record gave it 1 of its 21 tests
    and 90 of its mutants survived untested."""
    stats = root / "mutants" / "mutmut-stats.json"
    if not stats.exists():
        return False  # mutmut measures the whole suite
    try:
        commit = json.loads(stats.read_text()).get("git_commit") or "unknown"
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        return True  # damaged (a run killed mid-write) or not mutmut's: measure again
    # exit 1: the sources differ from that commit's; 128: the commit is unknown here
    diff = ["git", "diff", "--quiet", commit, "--", "src/grpo"]
    if subprocess.run(diff, cwd=root, capture_output=True).returncode != 0:
        return True
    new = ["git", "ls-files", "--others", "--exclude-standard", "--", "src/grpo"]
    return bool(subprocess.run(new, cwd=root, capture_output=True, text=True).stdout.strip())


def earlier_rows() -> dict[str, dict]:
    """module -> its row in the results file (the table as last written)."""
    return (
        {r["module"]: r for r in json.loads(RESULT.read_text())["rows"]} if RESULT.exists() else {}
    )


def function_of(mutant: str) -> str:
    """grpo.m.x_f__mutmut_3 -> x_f (mutmut's mangled function name)."""
    return mutant.rpartition("__mutmut_")[0].rpartition(".")[2]


@dataclass
class Changed:
    """A file's functions whose source differs between a recorded run's commit and now, with
    the in-scope mutants mutmut makes of them at that commit (``before``) and now (``now``)."""

    functions: list[str]
    before: list[str]
    now: list[str]
    total_before: int = 0  # all mutants of those functions, in scope or not
    total_now: int = 0


def changed_since(path: str, commit: str) -> Changed:
    """What of ``path`` changed since ``commit``: its mutants there are not the ones named now."""
    old = subprocess.run(
        ["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    then, now = (mutate_file_contents(path, code) for code in (old, (ROOT / path).read_text()))
    keys = set(then.hash_by_function_name) | set(now.hash_by_function_name)
    functions = sorted(
        k for k in keys if then.hash_by_function_name.get(k) != now.hash_by_function_name.get(k)
    )
    module = module_of(path)

    def scoped(names: Sequence[str]) -> list[str]:
        full = [f"{module}.{n}" for n in names if function_of(f"{module}.{n}") in functions]
        return sorted(in_scope(path, dict.fromkeys(full)))

    def count(names: Sequence[str]) -> int:
        return sum(function_of(f"{module}.{n}") in functions for n in names)

    return Changed(
        functions,
        scoped(then.mutant_names),
        scoped(now.mutant_names),
        count(then.mutant_names),
        count(now.mutant_names),
    )


def from_results(paths: list[str], fresh: Callable[[str, dict], bool]) -> dict[str, tuple]:
    """path -> (its row in the results file, what changed since that row's commit), for the
    ``paths`` with a row that ``fresh(path, row)`` accepts."""
    earlier = earlier_rows()
    rows = {p: earlier[p.removeprefix("src/grpo/")] for p in paths}
    return {p: (row, changed_since(p, row["commit"])) for p, row in rows.items() if fresh(p, row)}


def rechecked(row: dict, now: dict[str, int | None], commit: str, changed: Changed) -> dict:
    """An earlier row whose survivors were run again at ``commit`` (``now``: exit codes), and
    whose ``changed`` functions were run whole: their earlier mutants leave the counts (all
    killed but the row's survivors among them; the row was a whole run) and their new ones come in.
    """
    gone = [k for k in row["survivors"] if function_of(k) in changed.functions]
    kept = [k for k in row["survivors"] if k not in gone]
    killed = [k for k in kept if now.get(k) not in (0, None)]
    fresh = [k for k in changed.now if now.get(k) is not None]
    fresh_survivors = [k for k in fresh if now[k] == 0]
    return {
        **row,
        "mutants": row["mutants"] - changed.total_before + changed.total_now,
        "in_scope": row["in_scope"] - len(changed.before) + len(changed.now),
        "checked": row["checked"] - len(changed.before) + len(fresh),
        "killed": row["killed"]
        - (len(changed.before) - len(gone))
        + len(killed)
        + len(fresh)
        - len(fresh_survivors),
        "survived": row["survived"] - len(gone) - len(killed) + len(fresh_survivors),
        "survivors": sorted([k for k in kept if k not in killed] + fresh_survivors),
        # the changed functions' counts are this commit's and the rest's sources are equal at
        # both, so a later re-check compares against this commit (counting no change twice)
        "commit": commit,
        "whole_run_at": row.get("whole_run_at", row["commit"]),
        **({"changed_since": changed.functions} if changed.functions else {}),
    }


def _git_show(ref: str, path: str) -> str:
    show = ["git", "show", f"{ref}:{path}"]
    return subprocess.run(show, cwd=ROOT, capture_output=True, text=True, check=True).stdout


def compare(ref: str) -> dict[str, Any]:
    """The results file at git ``ref`` against mutants/'s results, over the functions both
    measured with the same source: a function moved to another file keeps its mutants (mutmut
    numbers them within the function), so a move or a rename of its file changes nothing.
    Only ``ref``'s rows of whole files checked whole count (a narrowed row does not say which
    functions were in scope, nor a partly checked one, a sample, which mutants were checked);
    every mutant of such a row was checked, all killed but its survivors.
    -> {"before": {"checked", "killed"}, "now": {"checked", "killed"}, "functions": n,
    "left_out": the modules of the rows that do not count}."""
    old_rows = json.loads(_git_show(ref, str(RESULT.relative_to(ROOT))))["rows"]
    # keyed by (function, source hash): the same name in two files is two functions
    before: dict[tuple[str, str], tuple[int, int]] = {}  # -> (mutants, survived)
    left_out = []
    for row in old_rows:
        if not row["mutants"] == row["in_scope"] == row["checked"]:
            left_out.append(row["module"])
            continue
        path = f"src/grpo/{row['module']}"
        mutated = mutate_file_contents(path, _git_show(row["commit"], path))
        survivors = collections.Counter(function_of(k) for k in row["survivors"])
        totals = collections.Counter(function_of(f"m.{n}") for n in mutated.mutant_names)
        for function, digest in mutated.hash_by_function_name.items():
            before[function, digest] = (totals[function], survivors[function])
    # (function, source hash) -> [checked, killed]
    now: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for path in files():
        digests = function_hashes(path, (ROOT / path).read_text())
        for k, code in results(path).items():
            function = function_of(k)
            if code not in (None, NO_TESTS) and function in digests:
                counts = now[function, digests[function]]
                counts[0] += 1
                counts[1] += code != 0
    same = [key for key in before if key in now]
    return {
        "before": {
            "checked": sum(before[key][0] for key in same),
            "killed": sum(before[key][0] - before[key][1] for key in same),
        },
        "now": {
            "checked": sum(now[key][0] for key in same),
            "killed": sum(now[key][1] for key in same),
        },
        "functions": len(same),
        "left_out": left_out,
    }


# docs/testing.md's list of the survivors and why each is equivalent: a function name in backticks, then
# mutmut's numbers and ranges ("`pack` 39, 42-44 (and 110, 112)"); other parentheses are prose
EXPLAINED_FROM = "**Why each remaining survivor is equivalent.**"
TOKEN = re.compile(r"\s+|,|and\b|\(and[^)]*\)|\([^)]*\)|\d+(?:-\d+)?")


def explained(readme: str, functions: set[str]) -> set[str]:
    """(mangled function)__mutmut_N of every mutant docs/testing.md's survivor list names. A bare method
    name (`run_calls`) is matched to the one class of ``functions`` that has it."""
    if EXPLAINED_FROM not in readme:
        return set()  # no list: every survivor is reported unexplained
    section = readme.split(EXPLAINED_FROM)[1].split("\n## ")[0]
    names = set()
    for match in re.finditer(r"`([A-Za-z_][\w.]*)`", section):
        cls, _, name = match.group(1).rpartition(".")
        function = f"xǁ{cls}ǁ{name}" if cls else f"x_{name}"
        owners = [f for f in functions if f.endswith(f"ǁ{name}")]
        if function not in functions and not cls and len(owners) == 1:
            function = owners[0]
        pos = match.end()
        while (token := TOKEN.match(section, pos)) and token.end() > pos:
            text, pos = token.group(0), token.end()
            if text[0].isdigit() or text.startswith("(and"):
                for a, b in re.findall(r"(\d+)(?:-(\d+))?", text):
                    names |= {f"{function}__mutmut_{n}" for n in range(int(a), int(b or a) + 1)}
    return names


def unexplained(rows: list[dict], readme: str) -> tuple[list[str], list[str]]:
    """Survivors docs/testing.md does not list, and mutants it lists that do not survive."""
    survivors = {k.rpartition(".")[2] for r in rows for k in r["survivors"]}
    listed = explained(readme, {function_of(k) for r in rows for k in r["survivors"]})
    return sorted(survivors - listed), sorted(listed - survivors)


def report_unexplained(rows: list[dict]) -> None:
    """One line each for survivors docs/testing.md does not explain and listed ones that died."""
    readme = ROOT / "docs" / "testing.md"
    missing, stale = unexplained(rows, readme.read_text()) if readme.exists() else ([], [])
    # tests/bench/test_bench_mutation.py holds the two equal: explain the new ones, drop the dead
    if missing:
        print(f"docs/testing.md: {len(missing)} survivors not explained: {' '.join(missing)}")
    if stale:
        print(f"docs/testing.md: {len(stale)} listed as survivors were killed: {' '.join(stale)}")


def table(
    records: dict[str, dict[str, int | None]] | None = None, commit: str | None = None
) -> list[dict]:
    """One row per file from mutmut's records (mutants/**/*.meta), or from ``records``
    (path -> mutant -> exit code) where given. A file none of whose mutants has a result (a fresh
    clone, or a run of other files) keeps its row from the results file, commit included."""
    rows, earlier = [], earlier_rows()
    for path in files():
        codes = records[path] if records and path in records else recorded(path)
        scoped = in_scope(path, codes)
        module = path.removeprefix("src/grpo/")
        if all(v is None for v in scoped.values()) and module in earlier:
            rows.append(earlier[module])
            continue
        status = [
            STATUS.get(v, "timeout" if v in (24, -24, 36, 152, 255) else "other")
            for v in scoped.values()
        ]
        killed = status.count("killed") + status.count("timeout")
        checked = killed + status.count("survived")
        unchecked = len(scoped) - checked
        was = earlier[module]["in_scope"] - earlier[module]["checked"] if module in earlier else 0
        if module in earlier and unchecked > was:
            # mutmut forgets results when sources or tests change; a row built from what is
            # left would read as a whole table of fewer mutants
            print(
                f"mutation: {module}: {unchecked} mutants without a result in mutants/ (the "
                f"results file's row had {was}); this row counts them unchecked: run the file "
                "whole (--resume --files ...) for a full row",
                file=sys.stderr,
            )
        rows.append(
            {
                "module": module,
                "commit": commit,
                "mutants": len(codes),
                "in_scope": len(scoped),
                "checked": checked,
                "killed": killed,
                "survived": status.count("survived"),
                "no_tests": status.count("no tests"),
                "other": status.count("other"),
                "survivors": sorted(k for k, v in scoped.items() if v == 0),
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| module | mutants | in scope | checked | killed | survived | killed / checked |",
        "|---|---|---|---|---|---|---|",
    ]
    total = {
        k: sum(r[k] for r in rows) for k in ("mutants", "in_scope", "checked", "killed", "survived")
    }
    for r in [*rows, {"module": "all", **total}]:
        share = f"{100 * r['killed'] / r['checked']:.1f} %" if r["checked"] else "-"
        name = f"`{r['module']}`" if r["module"] != "all" else "**all**"
        lines.append(
            f"| {name} | {r['mutants']} | {r['in_scope']} | {r['checked']} | {r['killed']} "
            f"| {r['survived']} | {share} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-children", type=int, default=2)
    parser.add_argument(
        "--table", action="store_true", help="the results file's table and survivors, no run"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="only the unchecked mutants (and those no test reached)",
    )
    parser.add_argument("--survivors", action="store_true", help="only the surviving mutants")
    parser.add_argument("--sample", type=int, help="with --resume: this many, drawn at random")
    parser.add_argument(
        "--rechecked",
        action="store_true",
        help="the results file's table with the results mutants/ holds for its survivors "
        "(what a --survivors run on a fresh checkout, stopped before its end, has checked)",
    )
    parser.add_argument("--files", nargs="+", help="only these (e.g. logprobs.py rewards/*.py)")
    parser.add_argument(
        "--functions",
        nargs="+",
        help="with --resume or --survivors: only these functions' mutants (f, Class.method, *)",
    )
    parser.add_argument(
        "--compare",
        metavar="REF",
        help="the kill rate of mutants/'s results against the results file at git REF, over "
        "the functions both measured with the same source; no run",
    )
    args = parser.parse_args()
    if unmatched := unmatched_scope():
        sys.exit(f"mutation: SCOPE names what is not there: {'; '.join(unmatched)}")
    if args.compare:
        both = compare(args.compare)
        rates = {k: both[k]["killed"] / max(both[k]["checked"], 1) for k in ("before", "now")}
        print(json.dumps({**both, "kill_rate": rates}))
        return
    if args.sample is not None and not args.resume:
        parser.error("--sample draws from the unchecked mutants: use it with --resume")
    if args.functions and not (args.resume or args.survivors):
        parser.error("--functions narrows a re-check: use it with --resume or --survivors")
    if args.table:
        rows = list(earlier_rows().values())
        print(markdown(rows))
        for row in rows:
            print(f"{row['module']}: " + " ".join(k.rpartition(".")[2] for k in row["survivors"]))
        report_unexplained(rows)
        return
    wall, dropped, names, listed = None, 0, [], {}
    commit = head_commit()
    chosen = [
        path
        for path in files()
        if not args.files or any(fnmatch.fnmatch(path, f"src/grpo/{f}") for f in args.files)
    ]
    if not args.rechecked:
        # mutmut re-checks every mutant it is given by name, so a resumed run names only the
        # unchecked ones, after a first call (one cheap mutant) has refreshed the mutants
        mutmut = [str(Path(sys.executable).with_name("mutmut")), "run"]
        mutmut += ["--max-children", str(args.max_children)]
        names = [p for path in chosen for p in patterns()[path]]
        start = time.perf_counter()
        if (args.resume or args.survivors) and stale_test_map(ROOT):
            print("mutmut's test map is of other sources: deleted, so the suite is measured again")
            (ROOT / "mutants" / "mutmut-stats.json").unlink()
        if args.resume or args.survivors:
            before_all = {path: recorded(path) for path in chosen}
            before = {k: v for path in chosen for k, v in results(path).items()}
            subprocess.run([*mutmut, "grpo.rewards.length.x_soft_overlong__mutmut_1"], cwd=ROOT)
            after = {k: v for path in chosen for k, v in results(path).items()}
            dropped = sum(v is not None and after.get(k) is None for k, v in before.items())
            if dropped:
                # mutmut forgets a result when the tests or the source it depends on changed
                print(f"mutmut dropped {dropped} earlier results (tests or sources changed)")
            # survivors as recorded before the refresh, so a refresh cannot empty the list;
            # names mutmut no longer makes (the source changed) are left out
            records = before if args.survivors else after
            # unchecked: no result, or no test reached the function when mutmut last measured
            # (a test added to the selection since reaches it now)
            wanted = {0} if args.survivors else {None, NO_TESTS}
            names = [k for k, v in records.items() if v in wanted and k in after]
            if args.survivors:
                # files mutants/ holds no result for (a fresh clone or machine): the survivors
                # the results file lists; a function changed since that run makes other
                # mutants under the same names, so it is run whole instead
                listed = from_results(
                    [p for p in chosen if p.removeprefix("src/grpo/") in earlier_rows()],
                    lambda p, row: all(before_all[p].get(k) is None for k in row["survivors"]),
                )
                for path, (row, changed) in listed.items():
                    names += [
                        k
                        for k in row["survivors"]
                        if function_of(k) not in changed.functions and k in after
                    ]
                    names += changed.now
                    if changed.functions:
                        print(
                            f"{path}: changed since {row['commit']}, run whole: "
                            + ", ".join(changed.functions)
                        )
                if listed:
                    print(f"survivors of {len(listed)} files as the results file lists them")
            if args.functions:
                wanted = [mangled(module_of(p), f) for p in chosen for f in args.functions]
                names = [k for k in names if any(fnmatch.fnmatch(k, w) for w in wanted)]
            if args.sample is not None and args.sample < len(names):
                names = sorted(random.Random(0).sample(names, args.sample))
        # a busy machine can fail a timed test in mutmut's clean runs, which stops the run
        for attempt in range(3 if names else 0):
            if subprocess.run([*mutmut, *names], cwd=ROOT).returncode == 0:
                break
            print(f"mutmut failed (attempt {attempt + 1} of 3)", file=sys.stderr)
        wall = time.perf_counter() - start
    if args.rechecked:
        paths = [p for p in files() if p.removeprefix("src/grpo/") in earlier_rows()]
        listed = from_results(paths, lambda p, row: True)
    merged = None
    if args.survivors and dropped:
        # the table stays the one measured before the refresh (tests only added since), with
        # the survivors' new results: what a whole re-run would give, at a fraction of its cost
        merged = {
            path: {**codes, **{k: v for k, v in recorded(path).items() if k in names}}
            for path, codes in before_all.items()
        }
        print(f"table: the {dropped} dropped results as recorded, the survivors re-checked")
    rows = table(merged, commit)
    # files re-checked from the results file: their earlier row, survivors' results updated
    rows = [
        rechecked(listed[p][0], recorded(p), commit, listed[p][1])
        if (p := f"src/grpo/{r['module']}") in listed
        else r
        for r in rows
    ]
    # a run of some files changes their rows only: the others' records in mutants/ may hold
    # just the survivors an earlier re-check ran, which are not a table
    earlier = earlier_rows()
    rows = [
        earlier[r["module"]]
        if f"src/grpo/{r['module']}" not in chosen and r["module"] in earlier
        else r
        for r in rows
    ]
    print(markdown(rows))
    # a partial run keeps the runs recorded before it (their timings, what each killed)
    keep = (args.resume or args.survivors or args.files or args.rechecked) and RESULT.exists()
    runs = json.loads(RESULT.read_text()).get("runs", []) if keep else []
    if wall is not None:
        partial = args.resume or args.survivors
        ran = (
            len(names)
            if partial
            else sum(r["checked"] for r in rows if f"src/grpo/{r['module']}" in chosen)
        )
        what = "survivors" if args.survivors else "unchecked" if args.resume else "all"
        what += f" (random sample of {args.sample})" if args.sample is not None else ""
        run = {
            "files": args.files or "all",
            "which": what,
            "commit": commit,
            "mutants": ran,
            "wall_s": round(wall),
        }
        if args.functions:
            run["functions"] = args.functions
        if args.survivors:
            now = {k: v for path in chosen for k, v in results(path).items() if k in names}
            run["killed_now"] = sorted(k for k, v in now.items() if v not in (0, None))
        runs.append({**run, "s_per_mutant": round(wall / ran, 2) if ran else None})
    if args.rechecked:
        wanted = {
            k
            for row, changed in listed.values()
            for k in [*row["survivors"], *changed.now]
            if function_of(k) not in changed.functions or k in changed.now
        }
        now = {k: v for path in listed for k, v in recorded(path).items() if k in wanted}
        checked = [k for k, v in now.items() if v is not None]
        run = {"which": "survivors, stopped", "commit": commit, "mutants": len(wanted)}
        run |= {"checked": len(checked), "killed_now": sorted(k for k in checked if now[k] != 0)}
        runs.append(run)
    out = {
        "date": datetime.date.today().isoformat(),
        "mutmut": version("mutmut"),
        "max_children": args.max_children,
        "runs": runs,
        "rows": rows,
    }
    RESULT.write_text(json.dumps(out, indent=1) + "\n")
    report_unexplained(rows)  # after the write: a run's results never wait on docs/testing.md


if __name__ == "__main__":
    main()
