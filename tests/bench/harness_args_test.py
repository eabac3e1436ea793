"""The benchmark harness's command lines (bench/run.py): every typed flag of every subcommand
(counts, sizes, numbers, choices and lists of them), given no value, another option as its value,
0, -1, a word, a value past its bound, an unknown choice or a repeat, exits 2 with one line
naming the flag and the value, before anything is made: the
scratch directory the run is pointed at (--out, --path, --dir, the working directory and TMPDIR)
stays as it was. Plus the checks each subcommand makes of its flags together (CROSS_CHECKS), and
the harness's shared pieces: sizes, medians, rotation, the output directory it claims.

    python3 harness_args_test.py REPO
"""
import contextlib
import io
import os
import shutil
import sys
import tempfile
import unittest
from pathlib import Path

REPO = Path(sys.argv.pop(1) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2])
sys.path.insert(0, str(REPO / "bench"))

import run  # noqa: E402  bench/run.py
from harness import common  # noqa: E402

# Flags the subcommand needs besides the one under test ({w}: the scratch directory, where a
# refused run must make nothing; {bin}: zinf-bench; {fake}: a DeepSpeed tree without its ops).
REQUIRED = {
    "paths": ["--fast", "{w}/fast", "--slow", "{w}/slow"],
    "deepspeed-compat": ["--ds-src", "{fake}/src"],
}
# Tiny sizes first, so that a check that lets a bad value through costs a short run.
TINY = {
    "checkpoint": ["--state", "12M", "--ranks", "1", "--trials", "1", "--no-drop-caches"],
    "paths": ["--state", "24M", "--size", "4M", "--sub-group-size", "1M", "--rounds", "1"],
    "stage3-lm": ["--d-model", "160", "--layers", "1", "--seq", "8", "--batch", "2",
                  "--steps", "1"],
    "overlap": ["--layers", "1", "--width", "8", "--batch", "2", "--steps", "1", "--rounds", "1"],
    "deepspeed-compat": ["--params", "64", "--tensors", "2", "--size", "64", "--rounds", "1",
                         "--world-sizes", "1", "--states", "fp32", "--no-drop-caches"],
}

# (subcommand, flags, words of the message): the checks run() makes of flags together and of
# what they name, before anything is made.
CROSS_CHECKS = [
    ("adam-vs-torch", ["--bin", "{w}/no-bench"], ["is not an executable"]),
    ("checkpoint", ["--bin", "{w}/no-bench"], ["is not an executable"]),
    ("checkpoint", ["--path", "{w}/file"], ["is not a directory"]),
    ("checkpoint", ["--path", "{w}/fast", "--state", "1000T"], ["needs about"]),
    ("paths", ["--fast", "{w}/missing"], ["--fast", "is not a directory"]),
    ("paths", ["--slow", "{w}/file"], ["--slow", "is not a directory"]),
    ("paths", ["--weightings", ""], ["--weightings"]),
    ("stage3-lm", ["--d-model", "158"], ["give at least 159"]),
    ("stage3-lm", ["--batch", "3", "--np", "2"], ["--batch 3 is not a multiple of --np 2"]),
    ("stage3-lm", ["--no-table", "--no-side-by-side"], ["leave nothing to run"]),
    ("deepspeed-compat", ["--ds-src", "{w}/missing"], ["--ds-src", "not found"]),
    ("deepspeed-compat", ["--ds-src", "{w}/file"], ["not a tar.xz", "zero_to_fp32.py"]),
    ("deepspeed-compat", ["--ds-src", "{fake}/build"], ["not found", "zero_to_fp32.py"]),
    ("deepspeed-compat", ["--params", "8", "--tensors", "9"], ["--tensors 9", "--params 8"]),
    ("deepspeed-compat", ["--size", "8", "--tensors", "9"], ["--tensors 9", "--size 8"]),
    ("deepspeed-compat", ["--path", "{w}/file"], ["--path", "is not a directory"]),
    ("deepspeed-compat", ["--size", "1T"], ["needs about", "per parameter"]),
    ("deepspeed-compat", ["--train", "{w}/no-train"], ["is not an executable"]),
    ("deepspeed-compat", ["--world-sizes", "0"], ["--world-sizes", "'0'"]),
    ("deepspeed-compat", ["--world-sizes", "4097"], ["--world-sizes", "'4097'"]),
    ("deepspeed-compat", ["--world-sizes", "2,2"], ["--world-sizes", "a value repeats"]),
    ("deepspeed-compat", ["--world-sizes", "1,x"], ["--world-sizes", "'1,x'"]),
    ("vs-deepspeed", ["--deepspeed", "{fake}/scripts", "--ds-build", "{fake}/build",
                      "--ds-src", "{fake}/src", "--size", "1M", "--elements", "1M",
                      "--sub-group", "1M", "--rounds", "1", "--steps", "1"], ["not built"]),
]


def listing(top):
    return sorted(str(p.relative_to(top)) for p in Path(top).rglob("*"))


class Refusals(unittest.TestCase):
    def setUp(self):
        self.top = tempfile.mkdtemp(prefix="zinf-harness-args-")
        self.work = Path(self.top) / "scratch"
        for d in ("tmp", "fast", "slow"):
            (self.work / d).mkdir(parents=True)
        (self.work / "file").write_text("")
        # A DeepSpeed tree whose ops are not built: outside the scratch directory.
        self.fake = Path(self.top) / "deepspeed"
        for d in ("scripts", "build", "src/deepspeed/runtime/swap_tensor"):
            (self.fake / d).mkdir(parents=True)
        # deepspeed-compat finds DeepSpeed's two checkpoint tools in src (empty files).
        for d in ("src/deepspeed/utils", "src/deepspeed/checkpoint"):
            (self.fake / d).mkdir(parents=True)
        for f in ("scripts/ds_aio_bench.py", "scripts/ds_swapper_step.py",
                  "src/deepspeed/runtime/swap_tensor/pipelined_optimizer_swapper.py",
                  "src/deepspeed/utils/zero_to_fp32.py",
                  "src/deepspeed/checkpoint/ds_to_universal.py"):
            (self.fake / f).write_text("")
        self.old_cwd, self.old_tmp = os.getcwd(), os.environ.get("TMPDIR")
        os.chdir(self.work)
        os.environ["TMPDIR"] = str(self.work / "tmp")
        self.before = listing(self.work)

    def tearDown(self):
        os.chdir(self.old_cwd)
        if self.old_tmp is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = self.old_tmp
        shutil.rmtree(self.top)

    def refused(self, argv, *words):
        """bench/run.py argv exits 2 with every word in its stderr, nothing made."""
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = run.main(argv)
            except SystemExit as e:
                rc = e.code
        with self.subTest(argv=" ".join(argv)):
            self.assertEqual(rc, 2, err.getvalue())
            for word in words:
                self.assertIn(word, err.getvalue())
            self.assertEqual(listing(self.work), self.before, "a refused run made files")
        for name in sorted(set(listing(self.work)) - set(self.before), reverse=True):
            path = self.work / name  # each case on its own: what a failed one made goes
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def base(self, name, extra=()):
        """name's command line into the scratch directory: --out, --path (when it has one), the
        flags it needs, tiny sizes, then `extra` (which wins: argparse keeps the last)."""
        w = str(self.work)
        args = [name, "--out", f"{w}/out"]
        if any(a.option_strings == ["--path"] for a in self.subparser(name)._actions):
            args += ["--path", f"{w}/path"]
        args += REQUIRED.get(name, []) + TINY.get(name, []) + list(extra)
        return [a.format(w=w, fake=self.fake) for a in args]

    def subparser(self, name):
        parser = run.parser()
        subs = next(a for a in parser._actions if a.dest == "subcommand")
        return subs.choices[name]

    def test_every_typed_flag(self):
        """Each flag of a harness type refused with its value named: a missing value, another
        option as its value, and the bad values of its kind."""
        tried = 0
        for name, action in self.flags():
            flag, kind = action.option_strings[0], action.type.kind
            argv = self.base(name)
            self.refused(argv + [flag], flag, "expected one argument")
            self.refused(argv + [flag, "--help"], flag, "expected one argument")
            if kind in ("count", "size", "number"):
                lo, hi = action.type.bounds
                bad = ["-1", "x", "1e3", "0.0" if kind == "number" else "1.5"]
                bad.append("0" if lo > 0 else "-5")
                if kind == "count":
                    bad += [str(hi + 1), "08"]
                elif kind == "size":
                    bad.append("2048T")
                    if lo > 1:
                        bad.append(str(lo - 1))
            else:
                first = action.type.choices[0]
                bad = ["nonsense", f"{first},nonsense"]
                bad += [f"{first},{first}", ""] if kind == "list" else [first.upper() + "x"]
            for value in bad:
                self.refused(argv + [flag, value], flag, f"'{value}'")
            tried += 1
        self.assertGreater(tried, 40, "the harness has fewer typed flags than expected")

    def test_no_untyped_numbers(self):
        """A number flag parsed by int or float would take -1, 08 or 1e9: each uses the
        harness's types (common.count, size, number), which this test and the messages know."""
        parser = run.parser()
        subs = next(a for a in parser._actions if a.dest == "subcommand")
        for name, sub in subs.choices.items():
            for action in sub._actions:
                with self.subTest(subcommand=name, flag=action.option_strings):
                    self.assertNotIn(action.type, (int, float))

    def test_cross_checks(self):
        for name, flags, words in CROSS_CHECKS:
            self.refused(self.base(name, flags), *words)

    def test_unknown_subcommand_and_flag(self):
        self.refused(["no-such-benchmark"], "invalid choice")
        self.refused(["step", "--no-such-flag"], "--no-such-flag")

    def flags(self):
        parser = run.parser()
        subs = next(a for a in parser._actions if a.dest == "subcommand")
        for name, sub in subs.choices.items():
            for action in sub._actions:
                if action.option_strings and hasattr(action.type, "kind"):
                    yield name, action


class Shared(unittest.TestCase):
    def test_sizes(self):
        self.assertEqual(common.parse_size("64K"), 64 << 10)
        self.assertEqual(common.parse_size("1GiB"), 1 << 30)
        self.assertEqual(common.parse_size("2g"), 2 << 30)
        self.assertEqual(common.parse_size("1024T"), 1 << 50)
        for bad in ("", "1.5G", "-1", "1024T1", "1025T", "08", "1P", " 1G"):
            self.assertIsNone(common.parse_size(bad), bad)

    def test_median_and_rotation(self):
        self.assertEqual(common.median([3, 1, 2]), 2)
        self.assertEqual(common.median([4, 1, 3, 2]), 2.5)
        self.assertTrue(common.median([]) != common.median([]))  # nan
        self.assertEqual([common.rotate("abc", r) for r in range(4)],
                         [list("abc"), list("bca"), list("cab"), list("abc")])
        self.assertIsNone(common.ratio(1.0, 0.0))
        self.assertEqual(common.ratio(1.0, 4.0), 0.25)

    def test_claimed_directory(self):
        with tempfile.TemporaryDirectory() as top:
            top = Path(top)
            made = common.claim_dir(top / "new", "step")
            (made / "result").write_text("x")
            common.fresh_dir(made, "step")  # its own: emptied but for the marker
            self.assertEqual([p.name for p in made.iterdir()], [".made-by-step"])
            with self.assertRaises(common.UsageError):
                common.claim_dir(made, "paths")  # another benchmark's
            (top / "other").mkdir()
            (top / "other" / "keep").write_text("x")
            with self.assertRaises(common.UsageError):
                common.fresh_dir(top / "other", "step")
            self.assertTrue((top / "other" / "keep").exists())
            (top / "file").write_text("x")
            (top / "link").symlink_to(top / "new")
            for name in ("file", "link"):
                with self.assertRaises(common.UsageError):
                    common.claim_dir(top / name, "step")
            (top / "fake").mkdir()
            (top / "fake" / "keep").write_text("x")
            (top / "fake" / ".made-by-step").symlink_to(top / "file")  # a planted marker
            with self.assertRaises(common.UsageError):
                common.fresh_dir(top / "fake", "step")
            self.assertTrue((top / "fake" / "keep").exists())


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
