#!/usr/bin/env bash
# A libfabric that NIXL 1.5.1's LIBFABRIC plugin can load, for tests and benchmarks on hosts without
# EFA (docs/efa.md, "Running the LIBFABRIC backend without EFA"). Never for the systemd unit or deploy/:
# there the EFA installer's libfabric (/opt/amazon/efa/lib) and the real GPU driver serve.
#
#   scripts/libfabric.sh [TARBALL | PREFIX]
#
# TARBALL: libfabric source (default ../shared/third_party/libfabric-af8ddbe92f03.tar.gz, a main-branch
# commit with the FABRIC_1.10 symbols the plugin imports); PREFIX: an installed libfabric to use as it is.
# Builds into $KVPUSHD_LIBFABRIC_DIR (default build/libfabric) once and reuses it; installs Debian's build
# dependencies with apt-get when missing and running as root; fetches libcudart.so.13 (PyPI wheel
# nvidia-cuda-runtime) and, on a host without a GPU driver only, compiles a libcuda.so.1 that answers
# CUDA_ERROR_NO_DEVICE. Prints, as its last line, the LD_LIBRARY_PATH value that makes the plugin load
# (also written to $KVPUSHD_LIBFABRIC_DIR/ld_library_path, where the tests look when
# KVPUSHD_LIBFABRIC_LD_PATH is unset).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC=${1:-$ROOT/../shared/third_party/libfabric-af8ddbe92f03.tar.gz}
OUT=${KVPUSHD_LIBFABRIC_DIR:-$ROOT/build/libfabric}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

log() { echo "libfabric.sh: $*" >&2; }
die() { log "$*"; exit 1; }

apt_install() { # packages: installed only when running as root with apt-get, else a clear error
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        log "installing $*"
        DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2
    else
        die "missing: $* (apt-get install $*)"
    fi
}

# hwloc: the plugin links libhwloc.so.15 (libfabric's build does not need it).
[[ "$(ldconfig -p)" == *'libhwloc.so.15 '* ]] || apt_install libhwloc15

# 1. libfabric
if [ -d "$SRC" ]; then
    [ -e "$SRC/lib/libfabric.so.1" ] || die "$SRC is a folder without lib/libfabric.so.1"
    FABRIC_LIB=$(cd "$SRC/lib" && pwd)
else
    [ -f "$SRC" ] || die "no libfabric source at $SRC (give a tarball or an installed prefix)"
    NAME=$(basename "$SRC" .tar.gz)
    PREFIX=$OUT/$NAME
    FABRIC_LIB=$PREFIX/lib
    if [ -e "$PREFIX/.built" ]; then
        log "reusing $PREFIX"
    else
        missing=()
        for tool in autoconf:autoconf automake:automake libtoolize:libtool make:make pkg-config:pkg-config \
                    gcc:gcc; do
            command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
        done
        [ ${#missing[@]} = 0 ] || apt_install "${missing[@]}"
        WORK=$OUT/src-$NAME
        rm -rf "$WORK" "$PREFIX"
        mkdir -p "$WORK"
        tar xzf "$SRC" -C "$WORK"
        [ -x "$WORK/autogen.sh" ] || WORK=$(dirname "$(find "$WORK" -maxdepth 2 -name autogen.sh | head -1)")
        log "building libfabric from $SRC (a few minutes)"
        (
            cd "$WORK"
            ./autogen.sh
            # tcp and sockets are the providers a host without EFA can run; efa, verbs and the GPU
            # interfaces are the EFA installer's business on AWS.
            ./configure --prefix="$PREFIX" --disable-static --enable-tcp --enable-sockets --enable-shm \
                --enable-rxm --enable-udp --disable-efa --disable-verbs --disable-psm2 --disable-psm3 \
                --disable-opx --disable-usnic --disable-cxi --disable-ucx --disable-lpp \
                --without-cuda --without-rocr --without-ze --without-neuron --without-synapseai
            make -j"$(nproc)"
            make install
        ) >"$OUT/build-$NAME.log" 2>&1 || die "build failed; see $OUT/build-$NAME.log"
        rm -rf "$WORK"
        touch "$PREFIX/.built"
    fi
fi
# (not `nm | grep -q`: with pipefail, grep leaving early fails the pipe)
[[ "$(nm -D "$FABRIC_LIB/libfabric.so.1")" == *'fi_getinfo@@FABRIC_1.10'* ]] \
    || die "$FABRIC_LIB/libfabric.so.1 lacks fi_getinfo@FABRIC_1.10 (NIXL 1.5.1's plugin needs a libfabric newer than v2.6.0)"

# 2. libcudart.so.13 from the nvidia-cuda-runtime wheel
CUDART=$OUT/cudart
if ! ls "$CUDART"/libcudart.so.13* >/dev/null 2>&1; then
    log "fetching nvidia-cuda-runtime (libcudart.so.13)"
    rm -rf "$OUT/wheels" && mkdir -p "$OUT/wheels" "$CUDART"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$OUT/wheels" 'nvidia-cuda-runtime>=13,<14' >&2
    "$PYTHON" - "$OUT/wheels" "$CUDART" <<'PY'
import pathlib, sys, zipfile
wheels, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for wheel in wheels.glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if "/libcudart.so" in name:
                (dest / pathlib.PurePosixPath(name).name).write_bytes(z.read(name))
PY
    ls "$CUDART"/libcudart.so.13* >/dev/null 2>&1 || die "no libcudart.so.13 in the nvidia-cuda-runtime wheel"
fi

# 3. libcuda.so.1: the real driver where there is one; the no-device stub, in a folder of its own, where not
LD=$FABRIC_LIB:$CUDART
if [[ "$(ldconfig -p)" == *'libcuda.so.1 '* ]] || [ -e /dev/nvidiactl ]; then
    log "a GPU driver is present: no stub"
else
    STUB=$OUT/nodriver
    if [ ! -e "$STUB/libcuda.so.1" ] || [ "$ROOT/scripts/libcuda_nodriver.c" -nt "$STUB/libcuda.so.1" ]; then
        mkdir -p "$STUB"
        gcc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$STUB/libcuda.so.1" "$ROOT/scripts/libcuda_nodriver.c"
    fi
    LD=$LD:$STUB
fi
echo "$LD" >"$OUT/ld_library_path"
echo "$LD"
