#!/usr/bin/env bash
# Build the hetpeer image, also on a machine that reaches package indexes but no container registry:
# a Debian base image made with debootstrap, a wheelhouse gathered by the host's pip, then `docker build`
# with no network at all. Each step is skipped when its result is already there, so a second run takes
# seconds. Run it from anywhere; `docker/build.sh --help` tells the options.
set -euo pipefail
export LC_ALL=C  # a '.' in $EPOCHREALTIME, whatever the user's locale

usage() {
    cat <<'EOF'
usage: docker/build.sh [--image NAME] [--base IMAGE | --rebuild-base] [--online] [--mirror URL]
       docker/build.sh --print-mirror

Builds the hetpeer image from docker/Dockerfile, in three steps, each skipped when already done:
  1. the base image hetpeer-base:bookworm, when missing: debootstrap (minbase, with python3,
     python3-venv, python3-pip, ca-certificates, iproute2, iptables) from the Debian mirror in this machine's
     apt sources, then `docker import`. Needs root and the debootstrap package.
  2. a wheelhouse in docker/wheels/: torch==2.13.0 (CPU) and every dependency in pyproject.toml,
     gathered by the host's pip (its python must be the base image's, e.g. 3.11 for bookworm).
  3. the image, `docker build` with --build-arg BASE and WHEELS: no network needed.

options:
  --image NAME     the image to build (default hetpeer:latest)
  --base IMAGE     start from this image (e.g. python:3.11-slim) instead of making one
  --rebuild-base   make the base image again even if it exists
  --online         no wheelhouse: the image installs torch from the PyTorch CPU index and the rest
                   from PyPI
  --mirror URL     the Debian mirror for debootstrap, instead of the one in the apt sources
  --print-mirror   print the Debian mirror debootstrap would use and exit
                   (HETPEER_APT_DIR names another directory than /etc/apt to read them from)
  -h, --help       this help

environment: PYTHON, the host's python for pip (default python3).
EOF
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SUITE=bookworm
PACKAGES=python3,python3-venv,python3-pip,ca-certificates,iproute2,iptables
TORCH=torch==2.13.0          # the same pin as docker/Dockerfile's
WHEELS=docker/wheels         # relative to ROOT: the Dockerfile's WHEELS and the dockerignore's folder
DEFAULT_BASE=hetpeer-base:$SUITE-2  # -2: iptables added (the testbed's NAT routers); a new list, a new tag
PYTHON=${PYTHON:-python3}

image=hetpeer:latest
base=$DEFAULT_BASE
base_given=false
rebuild_base=false
online=false
mirror=
print_mirror=false

say() { printf 'build.sh: %s\n' "$*"; }
die() { printf 'build.sh: error: %s\n' "$*" >&2; exit 1; }
usage_error() { printf 'build.sh: error: %s (see --help)\n' "$*" >&2; exit 2; }

# A step prints one line: what it does, then how it ended and how long it took.
step_started=
begin() { step_started=$EPOCHREALTIME; step="$1"; printf 'build.sh: %s ... ' "$1"; }
end() {
    awk -v a="$step_started" -v b="$EPOCHREALTIME" -v what="$1" 'BEGIN { printf "%s (%.1f s)\n", what, b - a }'
    step_started=
}

debian_mirror() {
    # The first `deb` source of $SUITE with component main, in the order apt reads its sources:
    # sources.list, then sources.list.d/ by name (one-line *.list and deb822 *.sources files).
    local dir=${HETPEER_APT_DIR:-/etc/apt} file found=
    local files=()
    [[ -f $dir/sources.list ]] && files+=("$dir/sources.list")
    for file in "$dir"/sources.list.d/*; do
        [[ -f $file && ( $file == *.list || $file == *.sources ) ]] && files+=("$file")
    done
    for file in "${files[@]}"; do
        if [[ $file == *.sources ]]; then
            found=$(awk -v suite="$SUITE" '
                function has(list, word,   n, k, a) {
                    n = split(list, a, " ")
                    for (k = 1; k <= n; k++) if (a[k] == word) return 1
                    return 0
                }
                function stanza(   u) {
                    if (has(f["types"], "deb") && tolower(f["enabled"]) != "no" && has(f["suites"], suite) \
                        && has(f["components"], "main") && split(f["uris"], u, " ") && u[1] ~ /^(https?|ftp|file):/) {
                        print u[1]; done = 1; exit
                    }
                    split("", f)
                }
                /^[ \t]*#/ { next }
                /^[ \t]*$/ { stanza(); next }
                /^[ \t]/   { f[key] = f[key] " " $0; next }  # a folded field goes on
                /:/        { key = tolower(substr($0, 1, index($0, ":") - 1))
                             f[key] = substr($0, index($0, ":") + 1)
                             gsub(/^[ \t]+|[ \t]+$/, "", f[key]); next }
                END        { if (!done) stanza() }' "$file")
        else
            found=$(awk -v suite="$SUITE" '
                { sub(/#.*/, "") }
                $1 == "deb" {
                    i = 2
                    if ($i ~ /^\[/) { while ($i !~ /\]$/ && i < NF) i++; i++ }  # [ options ]
                    if ($(i + 1) != suite || $i !~ /^(https?|ftp|file):/) next
                    for (j = i + 2; j <= NF; j++) if ($j == "main") { print $i; exit }
                }' "$file")
        fi
        if [[ -n $found ]]; then
            printf '%s\n' "${found%/}"
            return 0
        fi
    done
    die "no Debian $SUITE source with component main in $dir/sources.list or $dir/sources.list.d/; pass --mirror URL or --base IMAGE"
}

while (( $# )); do
    case $1 in
        --image) (( $# >= 2 )) || usage_error "--image needs a NAME"; image=$2; shift ;;
        --base) (( $# >= 2 )) || usage_error "--base needs an IMAGE"; base=$2; base_given=true; shift ;;
        --rebuild-base) rebuild_base=true ;;
        --online) online=true ;;
        --mirror) (( $# >= 2 )) || usage_error "--mirror needs a URL"; mirror=$2; shift ;;
        --print-mirror) print_mirror=true ;;
        -h|--help) usage; exit 0 ;;
        *) usage_error "unknown argument: $1" ;;
    esac
    shift
done
if $print_mirror; then
    if [[ -n $mirror ]]; then printf '%s\n' "$mirror"; else debian_mirror; fi
    exit 0
fi
if $base_given && $rebuild_base; then
    usage_error "--rebuild-base makes $DEFAULT_BASE; it does not go with --base"
fi

# What the commands print goes to a log, shown (its end) only when a step fails.
log=$(mktemp "${TMPDIR:-/tmp}/hetpeer-build.XXXXXX.log")
rootfs=
new_wheels=
step=
cleanup() {
    local status=$?
    if [[ -n $rootfs ]]; then
        # debootstrap mounts /proc and /sys in the target; a failed run may leave them mounted
        awk -v d="$rootfs/" 'index($2, d) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r umount -l || true
        rm -rf --one-file-system "$rootfs"
    fi
    [[ -n $new_wheels ]] && rm -rf "$new_wheels"
    if (( status != 0 )) && [[ -n $step_started ]]; then
        printf 'failed\n'
        tail -n 30 "$log" >&2
        printf 'build.sh: error: %s failed (exit %d); the whole log: %s\n' "$step" "$status" "$log" >&2
    else
        rm -f "$log"
    fi
}
trap cleanup EXIT

command -v docker >/dev/null || die "docker not found: install Docker Engine (the docker.io package)"
docker info >/dev/null 2>&1 || die "docker is not reachable (\`docker info\` fails): start dockerd, or check DOCKER_HOST and your access to its socket"

# 1. The base image.
if $base_given; then
    if docker image inspect "$base" >/dev/null 2>&1; then
        begin "base image $base"; end "present"
    else
        begin "base image $base: docker pull"
        docker pull "$base" >>"$log" 2>&1
        end "pulled"
    fi
elif docker image inspect "$base" >/dev/null 2>&1 && ! $rebuild_base; then
    begin "base image $base"; end "present, kept"
else
    command -v debootstrap >/dev/null || die "debootstrap not found: install the debootstrap package (apt-get install debootstrap), or pass --base IMAGE"
    (( EUID == 0 )) || die "debootstrap needs root: run build.sh as root, or pass --base IMAGE"
    [[ -n $mirror ]] || mirror=$(debian_mirror)
    rootfs=$(mktemp -d "${TMPDIR:-/var/tmp}/hetpeer-base.XXXXXX")
    begin "base image $base: debootstrap $SUITE from $mirror, docker import"
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$mirror" >>"$log" 2>&1
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*  # apt's downloads
    # An imported image has no config: give it what a Debian image from a registry has.
    tar -C "$rootfs" --numeric-owner -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' \
        --message "debootstrap --variant=minbase --include=$PACKAGES $SUITE" - "$base" >>"$log" 2>&1
    rm -rf --one-file-system "$rootfs"
    rootfs=
    end "made"
fi

# 2. The wheelhouse: built when the host's python is the base image's, since pip picks wheels for the
# python it runs on.
use_wheels=false
if $online; then
    say "wheelhouse: none (--online): the image installs from the PyTorch CPU index and PyPI"
else
    begin "wheelhouse $WHEELS: python of host and base image"
    host_python=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || host_python=none
    base_python=$(docker run --rm --entrypoint python3 "$base" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [[ $host_python != "$base_python" ]]; then
        end "host $PYTHON is $host_python, the base image's python $base_python: no wheelhouse, the image installs from the indexes"
    elif ! "$PYTHON" -m pip --version >/dev/null 2>&1; then
        end "$PYTHON has no pip: no wheelhouse, the image installs from the indexes"
    else
        end "both $host_python"
        use_wheels=true
        # The wheelhouse is complete when it was gathered for these inputs and its wheels are all there.
        key=$(printf 'python %s\n%s\npyproject.toml %s\n' "$host_python" "$TORCH" \
            "$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)")
        stamp=$ROOT/$WHEELS/.stamp
        complete=false
        if [[ -f $stamp && $(head -n 3 "$stamp") == "$key" ]]; then
            complete=true
            while read -r wheel; do
                [[ -f $ROOT/$WHEELS/$wheel ]] || complete=false
            done < <(tail -n +4 "$stamp")
        fi
        if $complete; then
            begin "wheelhouse $WHEELS"; end "complete for this pyproject.toml, kept"
        else
            begin "wheelhouse $WHEELS: pip wheel $TORCH and pyproject.toml's dependencies"
            mapfile -t requirements < <("$PYTHON" -c 'import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))
print("\n".join(p["project"]["dependencies"] + p["build-system"]["requires"]))' "$ROOT/pyproject.toml")
            new_wheels=$(mktemp -d "$ROOT/docker/.wheels.XXXXXX")
            "$PYTHON" -m pip wheel --wheel-dir "$new_wheels" "$TORCH" "${requirements[@]}" >>"$log" 2>&1
            { printf '%s\n' "$key"; (cd "$new_wheels" && ls -- *.whl); } > "$new_wheels/.stamp"
            chmod 755 "$new_wheels"
            rm -rf "${ROOT:?}/$WHEELS"
            mv "$new_wheels" "$ROOT/$WHEELS"
            new_wheels=
            end "$(find "$ROOT/$WHEELS" -name '*.whl' | wc -l) wheels, $(du -sm "$ROOT/$WHEELS" | cut -f1) MB"
        fi
    fi
fi

# 3. The image. The context goes as a tar of what docker/Dockerfile.dockerignore admits: a docker CLI
# without buildx builds with the classic builder, which ignores that file and would send the whole
# repository, .venv and .git included.
context=(docker/Dockerfile)
while read -r path; do
    path=${path%/}
    [[ -e $ROOT/$path ]] || continue
    [[ $path == "$WHEELS" ]] && ! $use_wheels && continue
    context+=("$path")
done < <(sed -n 's/^!//p' "$ROOT/docker/Dockerfile.dockerignore")
if $use_wheels; then how="from $base, offline from $WHEELS"; else how="from $base, from the indexes"; fi
begin "image $image: docker build $how"
tar -C "$ROOT" -c --exclude=__pycache__ --exclude='*.pyc' -- "${context[@]}" \
    | docker build -f docker/Dockerfile --build-arg BASE="$base" --build-arg WHEELS="$WHEELS" -t "$image" - \
    >>"$log" 2>&1
version=$(docker run --rm "$image" --version)
size_mb=$(( $(docker image inspect -f '{{.Size}}' "$image") / 1000000 ))
end "built: $version, $size_mb MB"
