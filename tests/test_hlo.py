"""hlo.py and hlo_graph.py: the optimized HLO parsed (loop trip counts, element sizes) and drawn."""

import re
import shutil
import subprocess
import xml.etree.ElementTree as ElementTree

import jax
import jax.numpy as jnp
from jax import lax

from seqax.analysis import hlo_graph


def compiled_loop():
    def f(w, x):
        return lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ w), x)

    return jax.jit(f).lower(jnp.ones((8, 8)), jnp.ones((4, 8))).compile()


def loop_hlo() -> str:
    return compiled_loop().as_text()


def test_hlo_graph_has_the_loop_body_and_its_matmul():
    dot = hlo_graph.to_dot(loop_hlo(), "f")
    assert "subgraph cluster_" in dot and "(x3)" in dot
    assert re.search(r'label="[^"]*(dot|fusion: dot)[^"]*", fillcolor="lightblue"', dot), dot
    if shutil.which("dot"):
        svg = subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True, check=True).stdout
        assert ElementTree.fromstring(svg).tag.endswith("svg")


