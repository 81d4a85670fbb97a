#!/bin/sh
# A root file system holding Python and a virtualenv, and nothing else: no shell, apt, dpkg or perl
# (a distroless-style base for llmesh's torch-free images; deploy/docker/Dockerfile's `gateway` and
# `light` targets copy it onto `scratch`).
#
#   minroot.sh DEST VENV
#
# Run in a Debian build stage with python3 (3.11) and binutils. DEST gets: the python3.11
# interpreter; its standard library without what a server never imports (tests, IDLE, tkinter,
# turtle, ensurepip, lib2to3, pydoc's topics, the curses/readline/dbm/sqlite modules, and nis and
# crypt, deprecated, whose libnsl pulls in Kerberos); VENV,
# trimmed (tests, type stubs, C sources, the wheels' extension modules stripped of debug symbols); the
# shared libraries that the interpreter, its extension modules and VENV's shared objects load,
# found with ldd (the ones wheels bundle stay in the wheels); libgcc_s (glibc loads it when a
# thread is cancelled); the CA bundle; passwd/group with `llmesh` (uid 10001); /tmp and
# /models. Merged /usr, as Debian's base: /bin, /lib, /lib64 are links into /usr.
set -eu
dest=$1
venv=$2
py=$(readlink -f "$(command -v python3)")   # /usr/bin/python3.11 (Debian), /usr/local/bin/... (python:slim)
ver=$(basename "$py")                          # python3.11
stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
rel=${stdlib#/}

mkdir -p "$dest/usr/bin" "$dest/usr/lib" "$dest/usr/lib64" "$dest/etc/ssl/certs" "$dest/tmp" \
    "$dest/models" "$dest/home/llmesh" "$dest/opt"
for d in bin lib lib64; do ln -s "usr/$d" "$dest/$d"; done
chmod 1777 "$dest/tmp"

# -- the interpreter and its standard library ---------------------------------------------------
mkdir -p "$dest$(dirname "$py")"
cp -a "$py" "$dest$py"
p3=$(command -v python3)                       # the venv's python links here
[ -e "$dest$p3" ] || [ -L "$dest$p3" ] || { mkdir -p "$dest$(dirname "$p3")"; cp -a "$p3" "$dest$p3"; }
tar -C / -cf - \
    --exclude="$rel/test" --exclude="$rel/idlelib" --exclude="$rel/tkinter" \
    --exclude="$rel/turtledemo" --exclude="$rel/turtle.py" \
    --exclude="$rel/ensurepip" --exclude="$rel/lib2to3" \
    --exclude="$rel/pydoc_data" --exclude="$rel/unittest/test" \
    --exclude="$rel/distutils/tests" --exclude="$rel/ctypes/test" \
    --exclude="$rel/sqlite3/test" --exclude="$rel/site-packages" --exclude="$rel/dist-packages" \
    --exclude="$rel/config-*" \
    --exclude="$rel/lib-dynload/_tkinter*" --exclude="$rel/lib-dynload/_curses*" \
    --exclude="$rel/lib-dynload/readline*" --exclude="$rel/lib-dynload/_dbm*" \
    --exclude="$rel/lib-dynload/_gdbm*" --exclude="$rel/lib-dynload/_sqlite3*" \
    --exclude="$rel/lib-dynload/nis*" --exclude="$rel/lib-dynload/_crypt*" \
    "$rel" | tar -C "$dest" -xf -
# Debian links sitecustomize.py to /etc/python3.X.
[ -d "/etc/$ver" ] && cp -a "/etc/$ver" "$dest/etc/"
# Debian's site.py also looks in /usr/lib/python3/dist-packages: an empty one keeps it quiet.
mkdir -p "$dest/usr/lib/python3/dist-packages"

# -- the virtualenv, trimmed --------------------------------------------------------------------
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
find "$site" -depth -type d -name tests -path "$site/*/*" -exec rm -rf {} +
find "$venv" -name '*.pyi' -delete
find "$venv" \( -name '*.c' -o -name '*.h' -o -name '*.pxd' -o -name '*.pyx' \) -delete
# Not the libraries auditwheel bundles (*.libs/): patchelf moved their segments, and strip breaks
# them ("ELF load command address/offset not page-aligned"); the images' RUN checks load the rest.
find "$venv" -name '*.so*' -type f -not -path '*.libs/*' -exec strip --strip-unneeded {} +
rm -rf "$venv/include" "$venv/share"
cp -a "$venv" "$dest/opt/"

# -- the shared libraries all of it loads -------------------------------------------------------
libs=$(
    { echo "$py"; find "$dest$stdlib/lib-dynload" "$venv" -name '*.so*' -type f; } \
    | xargs ldd 2>/dev/null \
    | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $1 ~ /ld-linux/ {print $1}' \
    | grep -v "^$venv/" | sort -u
)
gcc_s=$(ldconfig -p | awk '/libgcc_s.so.1 .*x86-64|libgcc_s.so.1 .*AArch64/ {print $NF; exit}')
for lib in $libs $gcc_s; do
    dir=$(readlink -f "$(dirname "$lib")")
    mkdir -p "$dest$dir"
    cp -L "$lib" "$dest$dir/$(basename "$lib")"
done
# The loader's cache: /usr/local/lib (python:slim's libpython) is not a default directory.
printf '/usr/local/lib\n' > "$dest/etc/ld.so.conf"
ldconfig -r "$dest"

# -- users, certificates ------------------------------------------------------------------------
printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' 'nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin' \
    'llmesh:x:10001:10001:llmesh:/home/llmesh:/sbin/nologin' > "$dest/etc/passwd"
printf '%s\n' 'root:x:0:' 'nogroup:x:65534:' 'llmesh:x:10001:' > "$dest/etc/group"
printf 'hosts: files dns\n' > "$dest/etc/nsswitch.conf"
cp -L /etc/ssl/certs/ca-certificates.crt "$dest/etc/ssl/certs/"
chown 10001:10001 "$dest/models" "$dest/home/llmesh"
