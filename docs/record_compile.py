"""Record the performance chapter's torch.compile section: one compile of a
tiny Llama, what Dynamo captured, where the graph was split, and what
Inductor generated for one piece.

tracevllm's own (the compile itself is tracevllm/compilation/, vLLM's
vllm/compilation/). ``python docs/record_compile.py`` runs ``tracevllm trace
--no-mp --no-enforce-eager -cc '{"mode": 3, "compile_sizes": [1]}' --detail
full`` on the 2-layer random-weight Llama of docs/record_parallel.py, in an
empty compile cache (``TRACEVLLM_CACHE_DIR``), so every piece is compiled, and
writes into docs/assets/recorded/:

- ``compile-pieces.md``: the split graph (the cache's ``computation_graph.py``)
  as a table, one row per piece: compiled or run between the compiled ones,
  its node count, and the source functions its nodes came from, in order;
- ``compile-call.txt``: Inductor's generated Python for the middle piece (one
  layer's o_proj and MLP, the next layer's norm, QKV and rotary embedding) at
  the general (symbolic) size: its ``call`` function, the oneDNN GEMMs left as
  extern calls and the fused C++ kernels between them (``del`` statements and
  alignment notes left out);
- ``compile-kernel.cpp``: one of those generated kernels, the fused SiLU-and-
  multiply of the MLP;
- ``facts.compile.json``: the figures the chapter quotes, from the run's spans
  (Dynamo's capture, each piece's compile per shape, the split).

Machine paths in the generated code are cut to the repository's. ``make
docs-assets`` does not run it and keeps what it wrote.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs"))

import record_assets as assets  # noqa: E402
import record_parallel  # noqa: E402

NAME = "compile"
OUTPUTS = ("compile-pieces.md", "compile-call.txt", "compile-kernel.cpp", "facts.compile.json")
PROMPT = "Hello there"
CONFIG = '{"mode": 3, "compile_sizes": [1]}'
CACHE = os.path.join(assets.RUNS_DIR, "compile-cache")
KERNEL = "cpp_fused_mul_silu_slice"


def run() -> None:
    out = assets.fresh_run_dir(NAME)
    shutil.rmtree(CACHE, ignore_errors=True)  # an empty cache: every piece compiles
    cmd = [os.path.join(ROOT, ".venv", "bin", "tracevllm"), "trace", "--model",
           record_parallel.model_dir(), "--prompt", PROMPT, "--max-tokens", "3", "--no-mp",
           "--no-enforce-eager", "--compilation-config", CONFIG, "--detail", "full",
           "--out", out]  # fmt: skip
    print("$", " ".join(cmd[1:]), flush=True)
    env = {**os.environ, "TRACEVLLM_CACHE_DIR": CACHE}
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT, env=env)


def _clean(text: str) -> str:
    """No machine path in the book: the repository's own files relative, the
    cache and the venv named."""
    text = text.replace(CACHE, "<cache>").replace(ROOT + "/", "")
    return text.replace(sys.prefix, "<venv>")


WIDTH = 84  # the book's code column at 1280 px, in characters (docs/check_site.py)


def _fold(text: str, comment: str) -> str:
    """Break generated lines longer than WIDTH so the book's code blocks do
    not scroll sideways: comments at spaces (each continuation a comment),
    code after a ``, ``, ``; `` or ``(``, continued eight columns in. For reading,
    not for running: the call's first line unpacks a tuple across the break."""
    out: list[str] = []
    for line in text.splitlines():
        indent = line[: len(line) - len(line.lstrip())]
        is_comment = line.lstrip().startswith(comment)
        cont = indent + (comment + "   " if is_comment else "        ")
        while len(line) > WIDTH:
            seps = (" ",) if is_comment else (", ", "; ", "(")
            cut = max(line.rfind(sep, len(cont) + 1, WIDTH) + len(sep) for sep in seps)
            if cut <= len(cont) + 1:
                break  # no place to break: leave it long
            out.append(line[:cut].rstrip())
            line = cont + line[cut:].lstrip()
        out.append(line)
    return "\n".join(out) + "\n"


def _pieces(graph_py: str) -> list[dict[str, Any]]:
    """Each ``class submod_N`` of computation_graph.py: is it a splitting
    piece, and the source functions (``# File: path:line in fn``) they came from."""
    pieces = []
    for m in re.finditer(r"class (submod_\d+)\(torch\.nn\.Module\):\n(.*?)(?=\n    class |\Z)",
                         graph_py, re.S):  # fmt: skip
        body = m.group(2)
        sources: list[str] = []
        for f in re.finditer(r"# File: (\S+):\d+ in (\w+)", body):
            where = f"{os.path.basename(f.group(1))[:-3]}.{f.group(2)}"
            if not sources or sources[-1] != where:
                sources.append(where)
        splitting = "unified_attention" in body or "unified_kv_cache_update" in body
        pieces.append({"name": m.group(1), "splitting": splitting, "sources": sources})
    return pieces


def _middle_wrapper(cache: str) -> str:
    """Inductor's generated module for the piece between the two layers'
    attentions, at the general size: the one with both the MLP's SiLU and the
    rotary embedding's index, and a symbolic size argument."""
    for dirpath, _, names in os.walk(cache):
        for name in names:
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name)) as f:
                text = f.read()
            if KERNEL in text and "cpp_fused_add_index" in text and "const int64_t ks0" in text:
                return text
    raise SystemExit("no generated module of the middle piece in the cache")


def _call(wrapper: str) -> str:
    body = wrapper[wrapper.index("    def call(self, args):") :]
    body = body[: body.index("\nrunner = Runner")]
    dropped = ("del ", "# buffer ")  # frees, and notes on alignment
    keep = [line[4:] for line in body.splitlines() if not line.strip().startswith(dropped)]
    return "\n".join(keep).rstrip() + "\n"


def _kernel(wrapper: str) -> str:
    """The kernel's C++, each ``static_cast<int64_t>(x)`` shown as ``(x)``,
    or ``x`` for a plain name or literal (Inductor casts every index)."""
    m = re.search(KERNEL + r"_\d+ = async_compile\.cpp_pybinding\(.*?r'''\n(.*?)'''", wrapper, re.S)
    assert m, f"{KERNEL} not found"
    cpp = re.sub(r"static_cast<int64_t>\(([\w.]+)\)", r"\1", m.group(1))
    return re.sub(r"static_cast<int64_t>\(([^()]*)\)", r"(\1)", cpp)


def draw() -> dict[str, Any]:
    spans = assets.load(NAME)
    backend = next(s for s in spans if s.name == "VllmBackend.split_and_compile")
    wrapper = next(s for s in spans if s.name == "TorchCompileWithNoGuardsWrapper.compile")
    cache_dir = str(backend.attributes["tracevllm.compile.cache_dir"])
    with open(os.path.join(cache_dir, "computation_graph.py")) as f:
        pieces = _pieces(f.read())
    compiles = sorted((s for s in spans if s.name == "CompilerManager.compile"),
                      key=lambda s: s.start_ns)  # fmt: skip
    nodes = {int(s.attributes["tracevllm.compile.graph_index"]):
             int(s.attributes["tracevllm.compile.graph_nodes"]) for s in compiles}  # fmt: skip
    rows = ["| piece | | FX nodes | what its nodes compute, in order |", "|---|---|---:|---|"]
    compiled = 0
    for p in pieces:
        if p["splitting"]:
            kind, count = "run between them (the attention op)", "1"
        else:
            kind, count = "compiled by Inductor", str(nodes[compiled])
            compiled += 1
        rows.append(f"| `{p['name']}` | {kind} | {count} | {' → '.join(p['sources'])} |")
    assets.write_text("compile-pieces.md", "\n".join(rows) + "\n")
    generated = _middle_wrapper(CACHE)
    assets.write_text("compile-call.txt", _fold(_clean(_call(generated)), "#"))
    assets.write_text("compile-kernel.cpp", _fold(_clean(_kernel(generated)), "//"))

    per_piece: dict[str, dict[str, float]] = {}
    for s in compiles:
        index = str(s.attributes["tracevllm.compile.graph_index"])
        shape = str(s.attributes["tracevllm.compile.runtime_shape"])
        seconds = float(s.attributes["tracevllm.compile.ms"]) / 1e3
        per_piece.setdefault(index, {})[shape] = round(seconds, 1)
    a = backend.attributes
    return {
        "compile": {
            "graph_nodes": int(a["tracevllm.compile.graph_nodes"]),
            "dynamo_s": round(float(a["tracevllm.compile.dynamo_ms"]) / 1e3, 1),
            "num_pieces": int(a["tracevllm.compile.num_pieces"]),
            "num_compiled_pieces": int(a["tracevllm.compile.num_compiled_pieces"]),
            "num_inductor_compiles": len(compiles),
            "splitting_ops": list(a["tracevllm.compile.splitting_ops"]),
            "pieces_s": round(float(a["tracevllm.compile.pieces_ms"]) / 1e3, 1),
            "total_s": round((wrapper.end_ns - wrapper.start_ns) / 1e9, 1),
            "per_piece_s": per_piece,
            "first_piece_general_s": per_piece["0"]["general"],
            "piece_nodes": [nodes[i] for i in sorted(nodes)],
        }
    }


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draw-only", action="store_true", help="re-draw from traces/docs/")
    if not parser.parse_args().draw_only:
        run()
    facts = draw()
    path = os.path.join(assets.OUT_DIR, "facts.compile.json")
    with open(path, "w") as f:
        json.dump(facts, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"  wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
