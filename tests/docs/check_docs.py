#!/usr/bin/python3
"""Keeps what the docs state about the repository true (README.md and docs/*.md).

  check_docs.py SOURCE_DIR

Checks, each failure one line naming the file and line:
  - counts: every "N bad configs" says the number of tests/config/bad_configs/*.json, and every
    "N DeepSpeed keys" / "N keys" the number of keys in docs/deepspeed-keys.md's table;
  - paths: every repository path cited in backticks outside code blocks (`launch/demo.sh`,
    `tests/config/bad_configs/`, the words of `python3 bench/run.py overlap ...`, and
    include paths: `zinf/comm/communicator.h` is comm/include/zinf/comm/communicator.h) exists;
    a path counts as one when its first component is a top-level folder of the repository or
    one the docs have named before (so a folder that is moved away is still checked);
  - links: every relative Markdown link names a file that exists, and its #anchor a heading of
    that file (GitHub's anchors).
Exit 0 when all hold, 1 with the list otherwise, 2 on a bad command line.
"""
import glob
import os
import re
import sys

# Top-level folders the docs cite; checked even when absent, so that a moved folder fails here.
KNOWN_TOP = {"core", "comm", "storage", "h5", "partition", "swapper", "checkpoint", "config",
             "engine", "launch", "python", "examples", "configs", "docs", "tests", "cmake",
             "bench", "tools", ".ci"}
# Folders the build makes or the docs name outside the tree; never checked.
NOT_IN_TREE = {"build", "build-asan", "build-tsan", "zinf-demo", "zinf-swap", "mlp-build"}


def docs_of(root):
    return [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))


def prose_lines(text):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)  # GitHub keeps letters, digits, _, - and spaces
    return s.replace(" ", "-")


def anchors(path):
    seen, result = {}, set()
    with open(path, encoding="utf-8") as f:
        for _, line in prose_lines(f.read()):
            m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if not m:
                continue
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            result.add(base if n == 0 else f"{base}-{n}")
    return result


def key_count(root):
    with open(os.path.join(root, "docs", "deepspeed-keys.md"), encoding="utf-8") as f:
        return sum(1 for line in f if line.startswith("| `"))


def main(argv):
    if len(argv) != 2 or not os.path.isdir(argv[1]):
        print("usage: check_docs.py SOURCE_DIR", file=sys.stderr)
        return 2
    root = os.path.abspath(argv[1])
    bad_configs = len(glob.glob(os.path.join(root, "tests", "config", "bad_configs", "*.json")))
    keys = key_count(root)
    if bad_configs == 0 or keys == 0:
        print(f"FAIL: found {bad_configs} bad configs and {keys} keys: wrong SOURCE_DIR?")
        return 1
    top = {e for e in os.listdir(root) if os.path.isdir(os.path.join(root, e))} | KNOWN_TOP
    top -= NOT_IN_TREE
    problems = []
    counted = {"bad configs": 0, "keys": 0}
    paths_checked = links_checked = 0
    anchor_cache = {}

    for doc in docs_of(root):
        rel = os.path.relpath(doc, root)
        with open(doc, encoding="utf-8") as f:
            text = f.read()
        lines = list(prose_lines(text))
        # Counts: joined so that a number and its noun may sit on two lines.
        joined = "\n".join(line for _, line in lines)
        starts = []  # offset in `joined` where each prose line starts
        offset = 0
        for number, line in lines:
            starts.append((offset, number))
            offset += len(line) + 1

        def line_at(pos):
            number = 0
            for start, n in starts:
                if start > pos:
                    break
                number = n
            return number

        for m in re.finditer(r"(?<![\w.-])(\d+)\s+bad\s+configs?\b", joined):
            counted["bad configs"] += 1
            if int(m.group(1)) != bad_configs:
                problems.append(f"{rel}:{line_at(m.start())}: says {m.group(1)} bad configs; "
                                f"tests/config/bad_configs/ holds {bad_configs}")
        for m in re.finditer(r"(?<![\w.-])(\d+)\s+(?:DeepSpeed\s+)?(?:config\s+)?keys\b", joined):
            counted["keys"] += 1
            if int(m.group(1)) != keys:
                problems.append(f"{rel}:{line_at(m.start())}: says {m.group(1)} keys; "
                                f"docs/deepspeed-keys.md lists {keys}")

        for number, line in lines:
            # Paths in inline code.
            for span in re.findall(r"`([^`]+)`", line):
                for word in span.split():
                    word = word.rstrip(".,;:)")
                    if "/" not in word or word.startswith(("/", "~", ".", "$", "http")):
                        continue
                    if re.search(r"[<>{}\[\]|=\"']", word):
                        continue  # a pattern (`<module>/src/`, `{core,comm}`) or an argument
                    header = re.fullmatch(r"zinf/(\w+)/([\w/]+\.h)", word)
                    if header:  # an include path: the module's public header
                        path = os.path.join(header.group(1), "include", word)
                    elif word.split("/", 1)[0] in top:
                        path = word
                    else:
                        continue
                    paths_checked += 1
                    if not glob.glob(os.path.join(root, path)):
                        problems.append(f"{rel}:{number}: `{word}` does not exist")
            # Relative Markdown links.
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue  # http:, https:, mailto:
                path, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
                links_checked += 1
                if not os.path.exists(dest):
                    problems.append(f"{rel}:{number}: link to {target}: {path} does not exist")
                    continue
                if anchor and dest.endswith(".md"):
                    if dest not in anchor_cache:
                        anchor_cache[dest] = anchors(dest)
                    if anchor not in anchor_cache[dest]:
                        problems.append(f"{rel}:{number}: link to {target}: no heading "
                                        f"#{anchor} in {os.path.relpath(dest, root)}")

    # The checks must have something to check, or a change of wording would pass them silently.
    if counted["bad configs"] == 0:
        problems.append("no doc states the number of bad configs any more: the check lost its object")
    if counted["keys"] == 0:
        problems.append("no doc states the number of DeepSpeed keys any more: the check lost its object")
    if problems:
        print("\n".join(f"FAIL: {p}" for p in problems))
        return 1
    print(f"PASS: {counted['bad configs']} statements of the {bad_configs} bad configs, "
          f"{counted['keys']} of the {keys} keys, {paths_checked} paths, {links_checked} links")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
