"""Guest side of the egress VM test: talks to the guest's proxy (127.0.0.1:3128)
the way clients do, and searches the guest for a secret it must not hold.

  raw REQUEST          send REQUEST (with \\r\\n escapes) to the proxy, print the answer
  sse                  stream https://api.anthropic.com/sse, print each event's arrival time
  ws                   upgrade https://api.anthropic.com/ws and echo one WebSocket frame
  scan MASK MASKED     search processes (environment, command line, memory) and files
                       for MASK xor MASKED (so the secret is not on this command line)
"""
import os
import socket
import ssl
import sys
import time
import urllib.request

PROXY = ("127.0.0.1", 3128)


def read_head(sock):
    head = b""
    while b"\r\n\r\n" not in head:
        byte = sock.recv(1)
        if not byte:
            break
        head += byte
    return head


def raw(request):
    sock = socket.create_connection(PROXY, timeout=30)
    sock.sendall(request)
    data = b""
    while len(data) < 65536:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            break
        if not chunk:
            break
        data += chunk
    sock.close()
    print(data.decode("latin-1"))


def sse():
    start = time.monotonic()
    with urllib.request.urlopen("https://api.anthropic.com/sse", timeout=60) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data:"):
                print("%.3f %s" % (time.monotonic() - start, line), flush=True)


def websocket():
    sock = socket.create_connection(PROXY, timeout=30)
    sock.sendall(b"CONNECT api.anthropic.com:443 HTTP/1.1\r\nHost: api.anthropic.com:443\r\n\r\n")
    head = read_head(sock)
    if not head.startswith(b"HTTP/1.1 200"):
        print("CONNECT refused:", head.decode("latin-1"))
        return
    tls = ssl.create_default_context().wrap_socket(sock, server_hostname="api.anthropic.com")
    tls.sendall(
        b"GET /ws HTTP/1.1\r\nHost: api.anthropic.com\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n"
    )
    print(read_head(tls).split(b"\r\n")[0].decode())
    mask = [1, 2, 3, 4]
    frame = bytes([0x81, 0x85] + mask) + bytes(b ^ mask[i % 4] for i, b in enumerate(b"hello"))
    tls.sendall(frame)
    echoed = b""
    while len(echoed) < len(frame):
        chunk = tls.recv(4096)
        if not chunk:
            break
        echoed += chunk
    print("websocket echo", "ok" if echoed == frame else "MISMATCH %r" % echoed)


def contains(path, needle, limit=1 << 26):
    try:
        with open(path, "rb") as f:
            return needle in f.read(limit)
    except OSError:
        return False


def memory_contains(pid, needle):
    scanned = 0
    try:
        maps = open("/proc/%s/maps" % pid).read().splitlines()
        mem = open("/proc/%s/mem" % pid, "rb", 0)
    except OSError:
        return False, 0
    for line in maps:
        fields = line.split()
        if "r" not in fields[1] or line.endswith("[vsyscall]"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        offset, tail = start, b""
        while offset < end:
            size = min(1 << 20, end - offset)
            try:
                mem.seek(offset)
                chunk = mem.read(size)
            except (OSError, OverflowError, ValueError):
                break
            if needle in tail + chunk:
                return True, scanned
            tail = chunk[-len(needle):]
            scanned += len(chunk)
            offset += size
    return False, scanned


def scan(mask_hex, masked_hex):
    mask, masked = bytes.fromhex(mask_hex), bytes.fromhex(masked_hex)
    needle = bytes(a ^ b for a, b in zip(masked, mask))
    found, processes, memory, files = [], 0, 0, 0
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if pid == me:
            continue
        processes += 1
        for part in ("environ", "cmdline"):
            if contains("/proc/%s/%s" % (pid, part), needle):
                found.append("/proc/%s/%s" % (pid, part))
        hit, scanned = memory_contains(pid, needle)
        memory += scanned
        if hit:
            found.append("memory of pid %s" % pid)
    for top in ("/etc", "/root", "/home", "/tmp", "/run", "/var", "/dev/shm"):
        for directory, _, names in os.walk(top):
            for name in names:
                path = os.path.join(directory, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    files += 1
                    if contains(path, needle):
                        found.append(path)
    print("scanned %d processes (%d MiB of memory) and %d files" % (processes, memory >> 20, files))
    print("FOUND " + ", ".join(found) if found else "CLEAN")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "raw":
        raw(sys.argv[2].encode().decode("unicode_escape").encode("latin-1"))
    elif mode == "sse":
        sse()
    elif mode == "ws":
        websocket()
    elif mode == "scan":
        scan(sys.argv[2], sys.argv[3])
    else:
        sys.exit("unknown mode " + mode)
