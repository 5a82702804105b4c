#!/usr/bin/env bash
# Build the operator and worker-cpu images with no container registry and no network in the
# build (make images-offline; docs/images.md):
#
#   1. dockerd: start it if it is not answering (needs root; flags for a host without a bridge)
#   2. a Debian bookworm rootfs with python3.11 + venv (debootstrap), cached as a tarball
#   3. docker import of that tarball as $BASE_IMAGE
#   4. a wheelhouse for every dependency (pip download on this host) in the build context
#   5. docker build --target operator / worker-cpu with PYTHON_BASE=$BASE_IMAGE OFFLINE=1
#
# Every step prints how long it took. Environment overrides:
#   CACHE_DIR   (.images)                      rootfs tarball and wheelhouse; gitignored
#   BASE_IMAGE  (ddpjob-local/python-base:bookworm)
#   TAG         (dev)                          images are ddpjob-operator:$TAG, ddpjob-worker-cpu:$TAG
#   MIRROR      (http://deb.debian.org/debian)
#   TORCH_INDEX_URL (https://download.pytorch.org/whl/cpu)  where pip download finds CPU torch;
#                                              skipped if unreachable (then the host's pip config
#                                              must provide a +cpu torch wheel, e.g. find-links)
#   PYTHON      (python3)                      the host python that runs pip download (3.11, glibc
#                                              >= the image's: the wheels must fit the image)
#   REFRESH=1                                  rebuild the rootfs and the wheelhouse
#   TORCH_BUILD (cpu)                          cpu: worker-cpu gets the CPU torch or the script
#                                              stops; any: where no CPU wheel can be had (the CPU
#                                              index unreachable), PyPI's torch, the CUDA build
#                                              with its nvidia-* wheels: it runs on CPU as well,
#                                              but the image is about 5 GB instead of 1 GB
set -euo pipefail

cd "$(dirname "$0")/.."
CACHE_DIR=${CACHE_DIR:-.images}
BASE_IMAGE=${BASE_IMAGE:-ddpjob-local/python-base:bookworm}
TAG=${TAG:-dev}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-python3}
REFRESH=${REFRESH:-0}
TORCH_BUILD=${TORCH_BUILD:-cpu}
case "$TORCH_BUILD" in cpu|any) ;; *) echo "images-offline: TORCH_BUILD must be cpu or any, not $TORCH_BUILD" >&2; exit 2;; esac
TORCH_INDEX_URL=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
ROOTFS_TAR="$CACHE_DIR/rootfs/bookworm-python3.tar"
WHEELHOUSE="$CACHE_DIR/wheelhouse"

now() { date +%s; }
step() { STEP_NAME=$1; STEP_START=$(now); echo "==> $1"; }
done_step() { echo "<== $STEP_NAME: $(($(now) - STEP_START)) s"; }

need() {
    command -v "$1" >/dev/null 2>&1 || { echo "images-offline: $1 not found ($2)" >&2; exit 1; }
}

# 1. dockerd --------------------------------------------------------------------------------
step "dockerd"
need docker "apt-get install docker.io"
if ! docker info >/dev/null 2>&1; then
    need dockerd "apt-get install docker.io"
    [ "$(id -u)" = 0 ] || { echo "images-offline: dockerd is not running and we are not root" >&2; exit 1; }
    echo "starting dockerd (log: /tmp/dockerd.log)"
    # No bridge and no iptables: a host that only allows a few outbound hosts, and builds that
    # need no network at all.
    nohup dockerd --bridge=none --iptables=false --ip-masq=false --ip-forward=false \
        >/tmp/dockerd.log 2>&1 &
    i=0
    until docker info >/dev/null 2>&1; do
        i=$((i + 1))
        [ "$i" -le 60 ] || { echo "dockerd did not start, see /tmp/dockerd.log" >&2; exit 1; }
        sleep 1
    done
fi
done_step

# 2. rootfs -----------------------------------------------------------------------------------
step "debootstrap bookworm (python3, python3-venv)"
if [ "$REFRESH" = 1 ] || [ ! -s "$ROOTFS_TAR" ]; then
    need debootstrap "apt-get install debootstrap"
    [ "$(id -u)" = 0 ] || { echo "images-offline: debootstrap needs root" >&2; exit 1; }
    mkdir -p "$(dirname "$ROOTFS_TAR")"
    rootfs=$(mktemp -d /tmp/ddpjob-rootfs.XXXXXX)
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" "$MIRROR"
    # Slimmer: no apt lists, caches, docs or man pages in the base.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/usr/share/doc/* \
        "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
    tar --numeric-owner -C "$rootfs" -cf "$ROOTFS_TAR.tmp" .
    mv "$ROOTFS_TAR.tmp" "$ROOTFS_TAR"
    rm -rf "$rootfs"
else
    echo "cached: $ROOTFS_TAR"
fi
done_step

# 3. docker import ----------------------------------------------------------------------------
step "docker import $BASE_IMAGE"
if [ "$REFRESH" = 1 ] || ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        "$ROOTFS_TAR" "$BASE_IMAGE"
else
    echo "present: $BASE_IMAGE"
fi
docker run --rm --network=none "$BASE_IMAGE" python3 -c "import sys, venv; print(sys.version)"
done_step

# 4. wheelhouse -------------------------------------------------------------------------------
step "pip download into $WHEELHOUSE"
if [ "$REFRESH" = 1 ]; then rm -rf "$WHEELHOUSE"; fi
mkdir -p "$WHEELHOUSE"
# Binary wheels only (nothing to compile in the build), for the host's python and platform,
# which must match the image's (bookworm, CPython 3.11, x86_64). setuptools is the build
# backend (the builder stage builds the ddpjob wheel in an isolated env from this wheelhouse).
# torch comes from the CPU index (or a local wheel the host's pip config points at); the
# constraints pin it to the CPU build the project tests.
torch_index=()
if [ -n "$TORCH_INDEX_URL" ]; then
    if "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" \
        "$TORCH_INDEX_URL" >/dev/null 2>&1; then
        torch_index=(--extra-index-url "$TORCH_INDEX_URL")
    else
        # pip would retry an unreachable index for minutes; the host's pip config may still
        # provide the CPU wheel (find-links), and the check below refuses anything else.
        echo "note: $TORCH_INDEX_URL is unreachable, torch must come from the host's pip config"
    fi
fi
"$PYTHON" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    "${torch_index[@]}" --dest "$WHEELHOUSE" -c constraints.txt 'setuptools>=68' '.[operator,worker]' \
    2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
# Never a CUDA torch (multi-GB, with nvidia-* wheels) in the wheelhouse unless TORCH_BUILD=any:
# the worker-cpu image should get the CPU build.
if ! ls "$WHEELHOUSE"/torch-*+cpu-*.whl >/dev/null 2>&1 || ls "$WHEELHOUSE"/nvidia_* >/dev/null 2>&1; then
    if [ "$TORCH_BUILD" != any ]; then
        echo "images-offline: the wheelhouse has no CPU torch (or has CUDA wheels): set TORCH_INDEX_URL to a CPU index that answers, or TORCH_BUILD=any to accept PyPI's CUDA build (about 5 GB)" >&2
        exit 1
    fi
    echo "note: TORCH_BUILD=any: worker-cpu gets PyPI's torch (the CUDA build, with nvidia-* wheels; it trains on CPU too, but the image is about 5 GB)"
fi
echo "$(ls "$WHEELHOUSE" | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)"
done_step

# 5. images -----------------------------------------------------------------------------------
for target in operator worker-cpu; do
    step "docker build --target $target"
    docker build --network=none --target "$target" \
        --build-arg PYTHON_BASE="$BASE_IMAGE" --build-arg OFFLINE=1 \
        -t "ddpjob-$target:$TAG" .
    done_step
done
docker images --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E '^ddpjob' || true
echo "worker-cuda is not built offline: it needs a CUDA PyTorch base image from a registry."
