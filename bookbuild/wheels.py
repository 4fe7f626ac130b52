"""Wheels for a CUDA machine without network: everything the book needs beyond that machine's torch stack.

    python -m bookbuild.wheels [--python 3.12] [--dest .whl]

The versions are this environment's, so a GPU run uses the libraries the cpu build was measured
with. The GPU machine's own Python keeps its torch, CUDA libraries and scientific stack (PROVIDED);
`bookbuild.gpu_check install` installs from the folder only what that machine lacks, plus the
libraries whose versions the chapters are about (MATCH), which it always takes from the folder.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOTS = ("trl", "bitsandbytes", "peft", "accelerate", "papermill", "jupytext", "ipykernel", "myst-nb", "docutils")
MATCH = ("trl", "bitsandbytes", "peft", "accelerate")
NO_DEPS = ("myst-nb",)  # the chapters use only its `glue` (which needs docutils); Sphinx serves the HTML build
# What a CUDA PyTorch image (Colab's, NGC's, the lent H200's) carries: its torch, CUDA libraries, scientific
# and Hugging Face/web stacks (transformers too: 13 MB, and the book runs on 5.x). Not carried; `gpu_check install` checks they import before any work.
PROVIDED = re.compile(r"^(torch|triton|transformers|nvidia-.*|cuda-.*|numpy|scipy|pandas|matplotlib|pyarrow|pillow|contourpy|"
                      r"kiwisolver|fonttools|cycler|pyparsing|sympy|networkx|mpmath|setuptools|pip|"
                      r"huggingface-hub|hf-xet|tokenizers|safetensors|httpx.*|httpcore.*|h11|anyio|sniffio|"
                      r"aiohttp|pydantic.*|annotated-.*|typing-.*|pygments|regex|pyyaml|requests|urllib3|certifi|"
                      r"idna|charset-normalizer|packaging|filelock|fsspec|jinja2|markupsafe|psutil|tqdm|rich|"
                      r"markdown-it-py|mdurl|click|typer|shellingham|attrs|python-dateutil|six|tzdata|xxhash|"
                      r"truststore)$")
OPTIONAL = ("jedi", "parso", "debugpy")  # IPython's completion and ipykernel's debugger: not needed to execute
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)) + ("manylinux2014_x86_64", "manylinux1_x86_64")
LIMIT_MB = 60


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(python: str) -> dict[str, str]:
    """{distribution: installed version ("" if not installed here)} of ROOTS and their requirements, as the target Python would need them."""
    from packaging.requirements import Requirement

    target = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    found, todo = {}, list(ROOTS)
    while todo:
        name = canonical(todo.pop())
        if name in found or PROVIDED.match(name) or name in OPTIONAL:
            continue
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # needed only by the target's Python: its newest release,
            found[name] = ""  # whose own requirements are not followed
            continue
        if name in NO_DEPS:
            continue
        for line in metadata.requires(name) or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(target):
                todo.append(requirement.name)
    return found


def _wanted(wheel: Path, wanted: dict[str, str], wheels: list[Path]) -> bool:
    """Whether `wheel` is the closure's version of its distribution (the newest present where none is pinned)."""
    from packaging.version import Version

    name, version = canonical(wheel.name.split("-")[0]), wheel.name.split("-")[1]
    if name not in wanted:
        return False
    if wanted[name]:
        return Version(version) == Version(wanted[name])
    present = [Version(w.name.split("-")[1]) for w in wheels if canonical(w.name.split("-")[0]) == name]
    return Version(version) == max(present)


def download(dest: Path, python: str) -> list[Path]:
    """Fill `dest` with one wheel per distribution of the closure; refuses past LIMIT_MB."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = closure(python)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", *platforms, "-d", str(dest),
                    *(f"{name}=={version}" if version else name for name, version in sorted(wanted.items()))], check=True)
    wheels = sorted(dest.glob("*.whl"))
    stale = [w for w in wheels if not _wanted(w, wanted, wheels)]
    for wheel in stale:  # another version's leftovers would install twice
        wheel.unlink()
    wheels = [w for w in wheels if w not in stale]
    size = sum(w.stat().st_size for w in wheels) / 2**20
    if size > LIMIT_MB:
        raise SystemExit(f"{dest} holds {size:.0f} MB of wheels, over the {LIMIT_MB} MB a GPU lease carries.")
    print(f"{len(wheels)} wheels for Python {python}, {size:.1f} MB, in {dest}")
    return wheels


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python, major.minor")
    parser.add_argument("--dest", default=".whl", type=Path)
    args = parser.parse_args(argv)
    download(args.dest, args.python)


if __name__ == "__main__":
    main()
