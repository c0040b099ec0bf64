#!/usr/bin/env bash
# .venv-maxtext: MaxText's training step and its compilers (bench/maxtext/requirements.txt), for
# bench/maxtext_anchor.py. MaxText 0.2.5 needs Python >= 3.12. When no such python3.x is on PATH (this
# project's machines run 3.11), it builds CPython 3.13 from Debian's source tarball (deb.debian.org,
# reachable where PyPI is; its SHA-256 checked below) into ~/.cache/seqax/python3.13: about 5 minutes on 2
# cores, once. It needs a C compiler and the usual -dev headers (ssl, zlib, ffi, bz2, lzma, sqlite3).
#
#   bash bench/maxtext/setup.sh        (or: make maxtext)
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="$root/.venv-maxtext"
cache="${SEQAX_CACHE:-$HOME/.cache/seqax}"
prefix="$cache/python3.13"
# Debian trixie's python3.13 source (its Sources index names the file and its SHA-256).
tarball_url="https://deb.debian.org/debian/pool/main/p/python3.13/python3.13_3.13.5.orig.tar.xz"
tarball_sha256="93e583f243454e6e9e4588ca2c2662206ad961659863277afcdb96801647d640"

find_python() {
    for candidate in python3.14 python3.13 python3.12 "$prefix/bin/python3.13"; do
        if command -v "$candidate" >/dev/null 2>&1 \
            && "$candidate" -c 'import sys, ssl, venv; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

build_python() {
    echo "no Python >= 3.12 here: building CPython 3.13.5 into $prefix (about 5 minutes, once)" >&2
    local work
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    curl -fsSL -o "$work/python.tar.xz" "$tarball_url"
    echo "$tarball_sha256  $work/python.tar.xz" | sha256sum -c --quiet -
    tar -xJf "$work/python.tar.xz" -C "$work"
    (cd "$work"/Python-3.13.* \
        && ./configure --quiet --prefix="$prefix" --with-ensurepip=install >/dev/null \
        && make -s -j"$(nproc)" >/dev/null \
        && make -s altinstall >/dev/null)
}

python="$(find_python || true)"
if [ -z "$python" ]; then
    build_python
    python="$(find_python)"
fi
echo "using $python ($("$python" -c 'import sys; print(sys.version.split()[0])'))"
rm -rf "$venv"
"$python" -m venv "$venv"
# --no-deps: exactly the pinned list (MaxText's declared dependencies serve its data pipelines, which a
# compile never runs; requirements.txt says so).
"$venv/bin/pip" install -q --no-deps -r "$here/requirements.txt"
"$venv/bin/python" -c 'import maxtext.trainers.pre_train.train_compile'
touch "$venv/.installed"
echo "ready: $venv"
