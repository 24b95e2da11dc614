#!/usr/bin/env python3
"""Servers for the remote-dataset tests and benchmark.

  objserver.py files DIR [--port P] [--max-connections N [--over wait]]
      A plain HTTP server of DIR's files with range requests (206), ETags
      and no listing: what a static file server or CDN offers. With N, a
      connection made while N are open is reset at once (a small server
      overwhelmed), or with --over wait answered only after 1.5 s (as a
      full accept queue keeps a client waiting for the kernel's SYN
      retry); GET /__faults counts them ("over").
  objserver.py proxy UPSTREAM [--port P] [--delay-ms D]
      A reverse proxy to UPSTREAM (an S3 server) that can delay, fail,
      reset and truncate: faults are set by POST /__faults with JSON
      {"delay_ms": 20, "status": {"count": 5, "code": 503},
       "reset": 2, "truncate": 1, "deny": "substring"}; GET /__faults
      returns what was served and injected.
  Both servers also lie as a hostile store would, by rules in the same
  JSON, {"lies": [RULE, ...]}, the first whose "path" is a substring of
  the request's path (and whose "methods", default GET and HEAD, hold
  its method) answering it instead:
      {"path": P, "status": 200, "length": L, "send": N, "echo": false,
       "pad": 0, "redirect": URL}
  declares Content-Length L (default: what is sent), sends N bytes of
  zeros (default L) after the request's own headers when "echo" and
  "pad" bytes of filler, then closes; "redirect" answers 302 to URL.
  GET /__faults counts "lies" answered and "lie_bytes" sent.
  objserver.py s3-load ENDPOINT BUCKET DIR PREFIX [DIR PREFIX ...]
      Creates BUCKET on an S3 server and uploads each DIR's files under its
      PREFIX.
  objserver.py s3-signed ACCESS_KEY SECRET_KEY
      moto's S3 server that checks every request's SigV4 signature (its
      IAM access control, on from the first request) against the one key
      pair given: a request signed with another secret is refused with
      403 SignatureDoesNotMatch, an unknown key with 403 InvalidAccessKeyId.
  objserver.py az-load ENDPOINT CONTAINER DIR PREFIX
      The same for azurite (ENDPOINT: its account URL,
      http://127.0.0.1:PORT/devstoreaccount1), with azurite's well-known
      account key.

The servers print `listening PORT` on their first line of stdout.
"""
import argparse
import email.utils
import hashlib
import http.client
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")


class Faults:
    def __init__(self, delay_ms=0):
        self.lock = threading.Lock()
        self.delay_ms = delay_ms
        self.status = {"count": 0, "code": 503}
        self.reset = 0
        self.truncate = 0
        self.deny = None
        self.lies = []
        self.seen = {"requests": 0, "status": 0, "reset": 0, "truncate": 0, "denied": 0,
                     "lies": 0, "lie_bytes": 0}

    def set(self, spec):
        with self.lock:
            self.delay_ms = spec.get("delay_ms", self.delay_ms)
            if "status" in spec:
                self.status = dict(spec["status"])
            self.reset = spec.get("reset", self.reset)
            self.truncate = spec.get("truncate", self.truncate)
            self.deny = spec.get("deny", self.deny)
            self.lies = spec.get("lies", self.lies)

    def lie_for(self, path, method):
        """The lie rule answering this request, if any."""
        with self.lock:
            for rule in self.lies:
                if rule["path"] in path and method in rule.get("methods", ["GET", "HEAD"]):
                    self.seen["lies"] += 1
                    return rule
        return None

    def take(self, path):
        """What to do with this request: None, or a fault's name."""
        with self.lock:
            self.seen["requests"] += 1
            if self.deny and self.deny in path:
                self.seen["denied"] += 1
                return "deny"
            for name in ("reset", "truncate"):
                if getattr(self, name) > 0:
                    setattr(self, name, getattr(self, name) - 1)
                    self.seen[name] += 1
                    return name
            if self.status["count"] > 0:
                self.status["count"] -= 1
                self.seen["status"] += 1
                return "status"
            return None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply(self, code, body=b"", headers=()):
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def control(self):
        faults = self.server.faults
        if self.command == "POST":
            n = int(self.headers.get("Content-Length", 0))
            faults.set(json.loads(self.rfile.read(n) or b"{}"))
        with faults.lock:
            body = json.dumps(faults.seen).encode()
        self.reply(200, body, [("Content-Type", "application/json")])

    def lie(self, rule):
        """Answers as `rule` says (see the module's doc)."""
        faults = self.server.faults
        self.close_connection = True
        if "redirect" in rule:
            return self.reply(302, b"", [("Location", rule["redirect"])])
        head = b""
        if rule.get("echo"):
            head = "".join(f"{k}: {v}\n" for k, v in self.headers.items()).encode()
        head += b"#" * rule.get("pad", 0)
        send = rule.get("send", rule.get("length", 0))
        length = rule.get("length", len(head) + send)
        self.send_response(rule.get("status", 200))
        self.send_header("Content-Length", str(length))
        self.send_header("ETag", '"lie"')
        self.end_headers()
        if self.command == "HEAD":
            return
        chunk, sent, left = b"\0" * (1 << 16), 0, send
        try:
            self.wfile.write(head)
            sent += len(head)
            while left > 0:
                n = min(left, len(chunk))
                self.wfile.write(chunk[:n])
                sent, left = sent + n, left - n
            self.wfile.flush()
        except OSError:
            pass  # the client stopped reading: what a bounded reader does
        finally:
            with faults.lock:
                faults.seen["lie_bytes"] += sent

    def fault(self, what, body_len_hint=1 << 16):
        faults = self.server.faults
        if what == "deny":
            self.reply(403, b"<Error><Code>AccessDenied</Code></Error>")
        elif what == "status":
            code = faults.status.get("code", 503)
            self.reply(code, SLOWDOWN if code == 503 else b"<Error><Code>InternalError</Code></Error>")
        elif what == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            self.close_connection = True
            self.connection.close()
        return what != "truncate"


class FileHandler(Handler):
    def do_HEAD(self):
        self.do_GET()

    def do_POST(self):
        if not self.path.startswith("/__faults"):
            return self.reply(405, b"read only")
        self.control()

    def do_GET(self):
        if self.path.startswith("/__faults"):
            return self.control()
        rule = self.server.faults.lie_for(self.path, self.command)
        if rule:
            return self.lie(rule)
        time.sleep(self.server.faults.delay_ms / 1000)
        what = self.server.faults.take(self.path)
        if what and self.fault(what):
            return
        rel = unquote(urlsplit(self.path).path).lstrip("/")
        full = os.path.realpath(os.path.join(self.server.root, rel))
        if not full.startswith(self.server.root + os.sep) or not os.path.isfile(full):
            return self.reply(404, b"not found")
        st = os.stat(full)
        etag = '"%s"' % hashlib.md5(f"{st.st_size}-{st.st_mtime_ns}".encode()).hexdigest()
        common = [("ETag", etag), ("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True)),
                  ("Accept-Ranges", "bytes")]
        with open(full, "rb") as f:
            data = f.read()
        rng = self.headers.get("Range")
        code, body = 200, data
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start = int(a)
            end = min(int(b) if b else len(data) - 1, len(data) - 1)
            if start >= len(data):
                return self.reply(416, b"", [("Content-Range", f"bytes */{len(data)}")])
            code, body = 206, data[start:end + 1]
            common.append(("Content-Range", f"bytes {start}-{end}/{len(data)}"))
        if what == "truncate":
            self.send_response(code)
            for k, v in common:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
            return
        self.reply(code, body, common)


class ProxyHandler(Handler):
    def relay(self):
        if self.path.startswith("/__faults"):
            return self.control()
        rule = self.server.faults.lie_for(self.path, self.command)
        if rule:
            self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
            return self.lie(rule)
        time.sleep(self.server.faults.delay_ms / 1000)
        what = self.server.faults.take(self.path)
        n = int(self.headers.get("Content-Length", 0) or 0)
        body = self.rfile.read(n) if n else None
        if what and self.fault(what):
            return
        local = self.server.tls
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.server.upstream[0], self.server.upstream[1], timeout=60)
            local.conn = conn
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
        except (OSError, http.client.HTTPException):
            local.conn = None
            return self.reply(502, b"upstream failed")
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("content-length", "connection", "transfer-encoding", "server", "date"):
                self.send_header(k, v)
        # A HEAD's length is the object's, not its (empty) body's.
        length = r.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if what == "truncate":
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            return
        self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = relay


class Server(ThreadingHTTPServer):
    # As many waiting connections as a broker opens (requests = 64 and
    # more): the default backlog of 5 drops connections under load.
    request_queue_size = 256
    max_connections = None
    over = "reset"
    open_connections = 0

    def process_request(self, request, client_address):
        if self.max_connections is not None:
            with self.faults.lock:
                over = self.open_connections >= self.max_connections
                if over:
                    self.faults.seen["over"] = self.faults.seen.get("over", 0) + 1
                else:
                    self.open_connections += 1
            if over and self.over == "wait":
                def later():
                    time.sleep(1.5)
                    ThreadingHTTPServer.process_request_thread(self, request, client_address)

                threading.Thread(target=later, daemon=True).start()
                return
            if over:
                # SO_LINGER 0: the close is a reset, as an overwhelmed server's.
                request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                self.shutdown_request(request)
                return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            if self.max_connections is not None:
                with self.faults.lock:
                    self.open_connections -= 1

    def handle_error(self, request, client_address):
        pass  # resets and truncations are what this server is for


def serve(server):
    server.daemon_threads = True
    print(f"listening {server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass


def files_under(pairs):
    """(path, key) of every file of each (DIR, PREFIX) pair."""
    for root, prefix in zip(pairs[::2], pairs[1::2]):
        for d, _, files in os.walk(root):
            for f in files:
                p = os.path.join(d, f)
                yield p, prefix + os.path.relpath(p, root)


def s3_load(endpoint, bucket, pairs):
    import boto3
    # The environment's key pair where one is set (a server that checks
    # signatures), else moto's usual one.
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
                      aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"))
    try:
        s3.create_bucket(Bucket=bucket)
    except (s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
        pass  # loaded before
    n = 0
    for p, key in files_under(pairs):
        with open(p, "rb") as fh:
            s3.put_object(Bucket=bucket, Key=key, Body=fh.read())
        n += 1
    print(n)


# azurite's documented development account (not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr"
               "/KBHBeksoGMGw==")


def az_load(endpoint, container, pairs):
    from azure.storage.blob import BlobServiceClient
    svc = BlobServiceClient(account_url=endpoint,
                            credential={"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY})
    c = svc.get_container_client(container)
    if not c.exists():
        c.create_container()
    n = 0
    for p, key in files_under(pairs):
        with open(p, "rb") as fh:
            c.upload_blob(key, fh, overwrite=True)
        n += 1
    print(n)


def s3_signed(access_key, secret_key):
    # Read by moto's settings as they are imported: authenticate every
    # request, none let through first.
    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.iam.models import iam_backends
    from moto.server import ThreadedMotoServer
    iam = iam_backends[DEFAULT_ACCOUNT_ID]["aws"]
    iam.create_user(region_name="us-east-1", user_name="batchcast-test")
    # moto makes up a key pair; the tests sign with theirs.
    key = iam.create_access_key("batchcast-test")
    key.access_key_id, key.secret_access_key = access_key, secret_key
    iam.put_user_policy("batchcast-test", "everything", json.dumps({
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    import logging
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    print(f"listening {srv.get_host_and_port()[1]}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("files")
    f.add_argument("root")
    f.add_argument("--port", type=int, default=0)
    f.add_argument("--max-connections", type=int, default=None)
    f.add_argument("--over", choices=["reset", "wait"], default="reset")
    p = sub.add_parser("proxy")
    p.add_argument("upstream")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--delay-ms", type=float, default=0)
    k = sub.add_parser("s3-signed")
    k.add_argument("access_key")
    k.add_argument("secret_key")
    s = sub.add_parser("s3-load")
    z = sub.add_parser("az-load")
    for q, store in ((s, "bucket"), (z, "container")):
        q.add_argument("endpoint")
        q.add_argument(store)
        q.add_argument("pairs", nargs="+", metavar="DIR PREFIX")
    a = ap.parse_args()
    if a.cmd in ("s3-load", "az-load") and len(a.pairs) % 2:
        ap.error(f"{a.cmd}: DIR PREFIX pairs expected, got {a.pairs}")
    if a.cmd == "files":
        srv = Server(("127.0.0.1", a.port), FileHandler)
        srv.root = os.path.realpath(a.root)
        srv.faults = Faults()
        srv.max_connections = a.max_connections
        srv.over = a.over
        serve(srv)
    elif a.cmd == "proxy":
        u = urlsplit(a.upstream)
        srv = Server(("127.0.0.1", a.port), ProxyHandler)
        srv.upstream = (u.hostname, u.port or 80)
        srv.tls = threading.local()
        srv.faults = Faults(a.delay_ms)
        serve(srv)
    elif a.cmd == "s3-signed":
        s3_signed(a.access_key, a.secret_key)
    elif a.cmd == "az-load":
        az_load(a.endpoint, a.container, a.pairs)
    else:
        s3_load(a.endpoint, a.bucket, a.pairs)


if __name__ == "__main__":
    sys.exit(main())
