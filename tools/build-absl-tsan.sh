#!/usr/bin/env bash
# Builds this machine's abseil (Debian 12's libabsl20220623: the same version, the same Debian
# patches, C++17, shared libraries with the same sonames) instrumented with ThreadSanitizer, into
# DIR/lib. `./wsync tsan` runs its tests with DIR/lib first on LD_LIBRARY_PATH, so that every
# absl::Mutex (ours, gRPC's, protobuf's) is one TSan sees: with the uninstrumented Debian build,
# every access guarded by an absl::Mutex would look like a race.
#   tools/build-absl-tsan.sh DIR     (idempotent: a finished DIR is kept)
# Needs the package's source: `apt-get source` from the Debian mirror (a deb-src entry is added
# under /etc/apt/sources.list.d if none gives it), then clang, cmake and ninja.
set -euo pipefail
out="$(realpath -m "${1:?usage: tools/build-absl-tsan.sh DIR}")"
if [ -f "$out/lib/libabsl_synchronization.so.20220623" ] && [ -f "$out/.done" ]; then
  echo "build-absl-tsan: $out is built"
  exit 0
fi
ver=$(dpkg-query -W -f='${Version}' libabsl-dev)
src="$out/src"
rm -rf "$src"
mkdir -p "$src"
cd "$src"
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
if ! apt-get source --download-only "abseil=$ver" > apt-source.log 2>&1; then
  echo "build-absl-tsan: adding a deb-src entry for bookworm (the package's source)"
  $sudo tee /etc/apt/sources.list.d/wsync-deb-src.sources > /dev/null <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  $sudo apt-get update -qq
  apt-get source --download-only "abseil=$ver" > apt-source.log 2>&1 || { cat apt-source.log >&2; exit 1; }
fi
tar xzf abseil_*.orig.tar.gz
dir=$(find . -maxdepth 1 -type d -name 'abseil-*' | head -n1)
tar xJf abseil_*.debian.tar.xz -C "$dir"
cd "$dir"
while read -r p; do
  [ -n "$p" ] && [ "${p#\#}" = "$p" ] && patch -p1 -s < "debian/patches/$p"
done < debian/patches/series
cmake -S . -B build -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_STANDARD=17 \
  -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DABSL_PROPAGATE_CXX_STD=ON \
  -DCMAKE_C_FLAGS="-fsanitize=thread" -DCMAKE_CXX_FLAGS="-fsanitize=thread" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" -DCMAKE_INSTALL_PREFIX="$out" -DCMAKE_INSTALL_LIBDIR=lib > /dev/null
cmake --build build -j"$(nproc)"
cmake --install build > /dev/null
[ -f "$out/lib/libabsl_synchronization.so.20220623" ] ||
  { echo "build-absl-tsan: no libabsl_synchronization.so.20220623 in $out/lib (soname changed?)" >&2; exit 1; }
rm -rf "$src"
touch "$out/.done"
echo "build-absl-tsan: $out/lib"
