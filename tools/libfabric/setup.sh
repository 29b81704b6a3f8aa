#!/usr/bin/env bash
# The LIBFABRIC test environment: libfabric with the tcp and shm providers, built
# from the vendored upstream snapshot into a prefix cached under the tarball's
# sha256, plus what NIXL's LIBFABRIC plugin links besides it (libhwloc.so.15, and on
# hosts without an NVIDIA driver a CPU stand-in for libcuda.so.1, built from
# tests/helpers/native/cuda_standin.c). On EFA hosts libfabric comes from the EFA installer
# and none of this runs.
#
#   tools/libfabric/setup.sh                build (or reuse) and say what is there
#   eval "$(tools/libfabric/setup.sh --env)" build (or reuse), then export KVPUSH_LIBFABRIC_PREFIX:
#                                           the tests run their LIBFABRIC cases (and must pass them)
#   tools/libfabric/setup.sh --ld-path      build (or reuse), print the LD_LIBRARY_PATH entries, e.g.
#       LD_LIBRARY_PATH=$(tools/libfabric/setup.sh --ld-path) kvpush doctor --nixl-backend LIBFABRIC
#   tools/libfabric/setup.sh --carry DIR    for a host with no package registry and no autotools
#                                           (the H200): DIR/libfabric-src-autogen.tar.gz (configure
#                                           already generated) and DIR/hwloc/libhwloc.so.15 (Debian's)
#
# Inputs (environment): KVPUSH_LIBFABRIC_TARBALL (default ../shared/vendor/libfabric-src.tar.gz
# beside the checkout, or beside the main checkout for a git worktree), KVPUSH_CACHE (default ~/.cache/kvpush), KVPUSH_HWLOC_DIR (a folder
# holding libhwloc.so.15, for hosts without the package), JOBS (make -j, default nproc),
# KVPUSH_LIBFABRIC_CUDA (a CUDA toolkit folder: build with CUDA memory support, FI_HMEM, into a
# prefix of its own; by default libfabric is built without it, as the tests need).
# The prefix holds kvpush-libfabric.json: what the tests and tools read (library_path, providers).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TARBALL=${KVPUSH_LIBFABRIC_TARBALL:-$ROOT/../shared/vendor/libfabric-src.tar.gz}
if [ -z "${KVPUSH_LIBFABRIC_TARBALL:-}" ] && [ ! -f "$TARBALL" ]; then
  # A worktree lives elsewhere than its main checkout; the vendored tarball sits beside the main one.
  common=$(git -C "$ROOT" rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)
  [ -n "$common" ] && [ -f "$common/../../shared/vendor/libfabric-src.tar.gz" ] \
    && TARBALL=$(cd "$common/../../shared/vendor" && pwd)/libfabric-src.tar.gz
fi
CACHE=${KVPUSH_CACHE:-$HOME/.cache/kvpush}
JOBS=${JOBS:-$(nproc)}
STANDIN_SRC=$ROOT/tests/helpers/native/cuda_standin.c
MODE=report
CARRY=""
case "${1:-}" in
  "") ;;
  --env) MODE=env ;;
  --ld-path) MODE=ld ;;
  --carry) MODE=carry; CARRY=${2:?--carry needs a folder} ;;
  -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
  *) echo "setup.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
esac

say() { echo "[libfabric] $*" >&2; }
die() { say "error: $*"; exit 1; }
# Is a library known to the loader's cache (the system's, not LD_LIBRARY_PATH)?
# (No grep -q: it would stop reading early, ldconfig would die of SIGPIPE, and pipefail would say "no".)
in_ld_cache() { /sbin/ldconfig -p 2>/dev/null | grep "[[:space:]]$1 " >/dev/null; }
apt_install() {
  command -v apt-get >/dev/null || return 1
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  say "installing Debian packages: $*"
  $sudo apt-get install -y -qq "$@" >/dev/null 2>&1 || { $sudo apt-get update -qq >/dev/null 2>&1 && $sudo apt-get install -y -qq "$@" >/dev/null; }
}

[ -f "$TARBALL" ] || die "no libfabric source tarball at $TARBALL (set KVPUSH_LIBFABRIC_TARBALL)"
SHA=$(sha256sum "$TARBALL" | cut -d' ' -f1)

# -- a pre-configured source tree and hwloc for a host without autotools or a registry ------------------
if [ "$MODE" = carry ]; then
  mkdir -p "$CARRY/hwloc"
  CARRY=$(cd "$CARRY" && pwd)
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  command -v autoreconf >/dev/null && command -v libtoolize >/dev/null || apt_install autoconf automake libtool \
    || die "autoconf/automake/libtool are missing and could not be installed"
  tar xzf "$TARBALL" -C "$work"
  src=$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -1)
  (cd "$src" && ./autogen.sh >/dev/null 2>&1) || die "autogen.sh failed in $src"
  echo "$SHA" >"$src/.kvpush-source-sha256"
  tar czf "$CARRY/libfabric-src-autogen.tar.gz" -C "$work" "$(basename "$src")"
  (cd "$work" && apt-get download libhwloc15 >/dev/null 2>&1) || die "apt-get download libhwloc15 failed"
  dpkg-deb -x "$work"/libhwloc15_*.deb "$work/deb"
  cp -L "$work"/deb/usr/lib/*/libhwloc.so.15 "$CARRY/hwloc/"
  say "carry folder ready: $(du -sh "$CARRY" | cut -f1) in $CARRY"
  ls -l "$CARRY" "$CARRY/hwloc" >&2
  exit 0
fi

PREFIX=$CACHE/libfabric-${SHA:0:16}
CUDA_FLAGS=(--without-cuda)
if [ -n "${KVPUSH_LIBFABRIC_CUDA:-}" ]; then
  CUDA_FLAGS=(--with-cuda="$KVPUSH_LIBFABRIC_CUDA" --enable-cuda-dlopen)
  PREFIX=$PREFIX-cuda
fi
MARKER=$PREFIX/kvpush-libfabric.json
mkdir -p "$CACHE"

# -- libfabric itself: built once per tarball (flock: concurrent runs wait for one build) ----------------
build() {
  local work src t0 t1
  work=$(mktemp -d)
  src_tar=$TARBALL
  tar xzf "$src_tar" -C "$work"
  src=$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -1)
  t0=$(date +%s)
  if [ ! -x "$src/configure" ]; then
    command -v autoreconf >/dev/null && command -v libtoolize >/dev/null || apt_install autoconf automake libtool \
      || die "the tarball has no configure script and autoconf/automake/libtool are missing (use --carry on a host that has them)"
    (cd "$src" && ./autogen.sh) >"$work/autogen.log" 2>&1 || { tail -20 "$work/autogen.log" >&2; die "autogen.sh failed"; }
  fi
  say "building libfabric (tcp, shm; no verbs/efa/psm; ${CUDA_FLAGS[*]}) into $PREFIX with $JOBS jobs"
  # Only the software providers: nothing here may pull rdma-core (it breaks UCX agents at exit).
  (cd "$src" && ./configure --prefix="$PREFIX" --disable-static \
      --enable-tcp --enable-shm --enable-sockets --enable-udp --enable-rxm --enable-rxd --enable-sm2 \
      --disable-verbs --disable-efa --disable-psm2 --disable-psm3 --disable-opx --disable-usnic \
      --disable-ucx --disable-cxi --disable-lnx --disable-xpmem \
      "${CUDA_FLAGS[@]}" --without-neuron --without-ze --without-rocr --without-gdrcopy \
      && make -j"$JOBS" && make install) >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; die "libfabric build failed"; }
  t1=$(date +%s)
  echo $((t1 - t0)) >"$PREFIX/.build-seconds"
  say "built in $((t1 - t0)) s"
  rm -rf "$work"
}

exec 9>"$PREFIX.lock"
flock 9
if [ ! -f "$PREFIX/lib/libfabric.so.1" ] || [ ! -f "$PREFIX/.build-seconds" ]; then
  rm -rf "$PREFIX"
  mkdir -p "$PREFIX"
  build
fi
grep -q "FABRIC_1.10" "$PREFIX/lib/libfabric.so.1" || die "$PREFIX/lib/libfabric.so.1 lacks FABRIC_1.10 (NIXL's plugin needs it)"

# -- what the plugin links besides libfabric ----------------------------------------------------------
LIBPATH=("$PREFIX/lib")
if ! in_ld_cache libhwloc.so.15; then
  if [ -n "${KVPUSH_HWLOC_DIR:-}" ] && [ -f "$KVPUSH_HWLOC_DIR/libhwloc.so.15" ]; then
    mkdir -p "$PREFIX/hwloc" && cp -L "$KVPUSH_HWLOC_DIR/libhwloc.so.15" "$PREFIX/hwloc/"
    LIBPATH+=("$PREFIX/hwloc")
  elif [ -f "$PREFIX/hwloc/libhwloc.so.15" ]; then
    LIBPATH+=("$PREFIX/hwloc")
  else
    apt_install libhwloc15 || die "libhwloc.so.15 is missing: install Debian's libhwloc15, or set KVPUSH_HWLOC_DIR"
  fi
fi

# The CUDA stand-in: only where no real driver is known to the loader (a GPU host must never get it).
STANDIN=""
real_driver() {
  in_ld_cache libcuda.so.1 || [ -d /proc/driver/nvidia ] && return 0
  # One the loader finds through LD_LIBRARY_PATH (a driver mounted elsewhere), unless it is our stand-in.
  python3 -c 'import ctypes, sys; lib = ctypes.CDLL("libcuda.so.1"); sys.exit(hasattr(lib, "kvpush_cuda_standin"))' 2>/dev/null
}
if real_driver; then
  rm -rf "$PREFIX/cuda-standin"
  say "a CUDA driver is installed: no stand-in"
else
  STANDIN=$PREFIX/cuda-standin
  mkdir -p "$STANDIN"
  rm -f "$STANDIN"/*.map
  cc=${CC:-cc}
  command -v "$cc" >/dev/null || die "no C compiler ($cc) to build the CUDA stand-in"
  "$cc" -shared -fPIC -O2 -DKVPUSH_STANDIN_DRIVER -Wl,-soname,libcuda.so.1 -o "$STANDIN/libcuda.so.1" "$STANDIN_SRC"
  # The runtime too, for each major the NIXL wheels link, when the host has none (versioned symbols).
  for major in 12 13; do
    rm -f "$STANDIN/libcudart.so.$major"
    if ! in_ld_cache "libcudart.so.$major"; then
      map=$(mktemp)
      printf 'libcudart.so.%s { global: cudaSetDevice; cudaGetErrorString; kvpush_cuda_standin; local: *; };\n' "$major" \
        >"$map"
      "$cc" -shared -fPIC -O2 -DKVPUSH_STANDIN_RUNTIME -Wl,-soname,"libcudart.so.$major" \
        -Wl,--version-script,"$map" -o "$STANDIN/libcudart.so.$major" "$STANDIN_SRC"
      rm -f "$map"
    fi
  done
  LIBPATH+=("$STANDIN")
fi

PROVIDERS=$(LD_LIBRARY_PATH="$PREFIX/lib" "$PREFIX/bin/fi_info" -l 2>/dev/null | sed -n 's/^\([a-z0-9_]*\):$/\1/p' | tr '\n' ' ')
case " $PROVIDERS " in *" tcp "*) ;; *) die "libfabric in $PREFIX has no tcp provider (fi_info -l: $PROVIDERS)" ;; esac
json_list() { local out="" x; for x in "$@"; do out+="${out:+, }\"$x\""; done; echo "[$out]"; }
# shellcheck disable=SC2086
cat >"$MARKER.tmp" <<EOF
{
  "prefix": "$PREFIX",
  "tarball_sha256": "$SHA",
  "build_seconds": $(cat "$PREFIX/.build-seconds"),
  "library_path": $(json_list "${LIBPATH[@]}"),
  "cuda_standin": $([ -n "$STANDIN" ] && echo "\"$STANDIN\"" || echo null),
  "providers": $(json_list $PROVIDERS)
}
EOF
mv "$MARKER.tmp" "$MARKER"
flock -u 9

LD=$(IFS=:; echo "${LIBPATH[*]}")
case "$MODE" in
  env) echo "export KVPUSH_LIBFABRIC_PREFIX=$PREFIX" ;;
  ld) echo "$LD" ;;
  report)
    say "prefix     $PREFIX (built in $(cat "$PREFIX/.build-seconds") s)"
    say "providers  $PROVIDERS"
    say "lib path   $LD"
    say "use:       eval \"\$(bash $0 --env)\"   (tests), or LD_LIBRARY_PATH=$LD kvpush doctor --nixl-backend LIBFABRIC" ;;
esac
