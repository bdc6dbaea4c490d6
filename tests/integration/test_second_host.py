#!/usr/bin/env python3
"""A second "host" in a network namespace the test creates: engines reached over a veth link.

The namespace has its own loopback and one end of a veth pair (10.77.N.2/24); the test's side
has the other end (10.77.N.1/24). Inside it run a prefill engine (`disaggregation.role:
prefill`) and a replica engine (`replicas.listen`), both listening on 10.77.N.2 only, so
nothing reaches them over the host's loopback. Outside: a decode engine whose prefill engine is
the one in the namespace, and a gateway whose replica is the one in the namespace. Checks:
  - outputs identical to a colocated engine through both (greedy and seeded), with the KV of
    every prompt moved across the link and every replica request answered across it;
  - the link cut (the veth taken down) while a greedy stream runs on the remote replica: the
    gateway's health probe marks it unhealthy, the stream continues on the gateway's own
    engine (`local: true`) with identical text, and new requests are served locally;
  - the link back up: the replica is healthy again.
Needs root (CAP_NET_ADMIN) and iproute2; exits 77 (skipped) where a namespace cannot be made.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

MODEL = "smollm2-135m-instruct-q4_1"
ONE_THREAD = f"model: {{path: {MODEL}, threads: 1}}\n"


def sh(*args, check=True):
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


class Namespace:
    """A network namespace joined to this one by a veth pair."""

    def __init__(self):
        n = os.getpid() % 200 + 20
        self.name = f"tessera-host2-{os.getpid()}"
        self.outer_if, self.inner_if = f"tsv{os.getpid() % 100000}a", f"tsv{os.getpid() % 100000}b"
        self.outer_ip, self.inner_ip = f"10.77.{n}.1", f"10.77.{n}.2"

    def create(self):
        sh("ip", "netns", "add", self.name)
        try:
            sh("ip", "link", "add", self.outer_if, "type", "veth", "peer", "name", self.inner_if)
            sh("ip", "link", "set", self.inner_if, "netns", self.name)
            sh("ip", "addr", "add", f"{self.outer_ip}/24", "dev", self.outer_if)
            sh("ip", "link", "set", self.outer_if, "up")
            self.run("ip", "addr", "add", f"{self.inner_ip}/24", "dev", self.inner_if)
            self.run("ip", "link", "set", self.inner_if, "up")
            self.run("ip", "link", "set", "lo", "up")
        except Exception:
            self.delete()
            raise

    def run(self, *args):
        return sh("ip", "netns", "exec", self.name, *args)

    def link(self, up):
        sh("ip", "link", "set", self.outer_if, "up" if up else "down")

    def delete(self):
        sh("ip", "link", "del", self.outer_if, check=False)
        sh("ip", "netns", "del", self.name, check=False)


class RemoteServer(h.Gateway):
    """A `tessera serve` inside the namespace, its HTTP API on the namespace's address."""

    def __init__(self, yaml, name, ns):
        super().__init__(yaml + f"server: {{host: {ns.inner_ip}}}\n", name)
        self.ns = ns

    def start(self, timeout=120):
        # Server.start runs TESSERA; run it through `ip netns exec` instead.
        real = h.TESSERA
        wrapper = os.path.join(self.dir, "in-namespace.sh")
        with open(wrapper, "w") as f:
            f.write(f"#!/bin/sh\nexec ip netns exec {self.ns.name} {real} \"$@\"\n")
        os.chmod(wrapper, 0o755)
        h.TESSERA = wrapper
        try:
            return super().start(timeout)
        finally:
            h.TESSERA = real

    @property
    def url(self):
        return f"http://{self.ns.inner_ip}:{self.port}"


def labelled(server, name, labels):
    m = re.search(rf'^{re.escape(name)}{{{re.escape(labels)}}} ([-+\d.e]+)$', server.metrics(), re.M)
    return float(m.group(1)) if m else None


def complete(server, prompt, max_tokens=24, **kw):
    r = server.openai_client().completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, **kw)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage.prompt_tokens


PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           " ".join(f"Item {i}: a {c} box." for i, c in enumerate(["red", "blue", "green", "gold"] * 12)) + " Count them:"]


def main():
    h.require_environment()
    if os.geteuid() != 0:
        h.skip_or_fail("a network namespace needs root (CAP_NET_ADMIN)")
    ns = Namespace()
    try:
        ns.create()
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        h.skip_or_fail(f"cannot create a network namespace here: {getattr(e, 'stderr', e)}".strip())
    check = h.Checks()

    started = []
    try:
        ports = [h.free_port(), h.free_port()]
        prefill = RemoteServer(f"extends: {h.DEFAULT_STACK}\n{ONE_THREAD}disaggregation:\n  role: prefill\n"
                               f"  connector: {{plugin: grpc}}\n  listen: {ns.inner_ip}:{ports[0]}\n",
                               "host2-prefill", ns).start()
        started.append(prefill)
        replica = RemoteServer(f"extends: {h.DEFAULT_STACK}\n{ONE_THREAD}replicas:\n  connector: {{plugin: grpc}}\n"
                               f"  listen: {ns.inner_ip}:{ports[1]}\n", "host2-replica", ns).start()
        started.append(replica)
        # They listen on the second host only: this host's loopback does not reach them.
        def reachable(host, port):
            try:
                socket.create_connection((host, port), timeout=2).close()
                return True
            except OSError:
                return False

        check(all(reachable(ns.inner_ip, p) and not reachable("127.0.0.1", p) for p in ports),
              f"prefill engine and replica listen on the second host ({ns.inner_ip}, namespace {ns.name}), "
              "not on this host's loopback")
        ref = h.Server(name="colocated").start()
        started.append(ref)
        decode = h.Gateway(f"extends: {h.DEFAULT_STACK}\n{ONE_THREAD}disaggregation:\n  role: decode\n"
                           f"  connector: {{plugin: grpc}}\n  prefill: [{ns.inner_ip}:{ports[0]}]\n", "host1-decode").start()
        started.append(decode)
        gw = h.Gateway(f"extends: {h.DEFAULT_STACK}\n{ONE_THREAD}replicas:\n"
                       "  connector: {plugin: grpc, connect_timeout: 0.5s}\n"
                       f"  endpoints: [{ns.inner_ip}:{ports[1]}]\n  local: true\n  health_interval: 0.2s\n"
                       "  router: {plugin: prefix-affinity, max_imbalance: 1000}\n", "host1-gateway").start()
        started.append(gw)
        dep = f'deployment="{MODEL}"'
        remote = f'{dep},replica="{ns.inner_ip}:{ports[1]}"'

        for p in PROMPTS:
            want = complete(ref, p, temperature=0)
            check(complete(decode, p, temperature=0) == want,
                  f"disaggregated across the link, {want[2]} prompt tokens: identical to colocated")
        want = complete(ref, PROMPTS[1], temperature=0.9, seed=11, max_tokens=32)
        check(complete(decode, PROMPTS[1], temperature=0.9, seed=11, max_tokens=32) == want,
              "disaggregated across the link, seeded: identical")
        remote_prefills = labelled(decode, "tessera_disagg_remote_prefills_total", dep)
        check(remote_prefills == len(PROMPTS) + 1 and labelled(decode, "tessera_disagg_local_prefills_total", dep) == 0,
              f"... every prompt was prefilled on the second host ({remote_prefills:.0f}), "
              f"{labelled(decode, 'tessera_disagg_kv_bytes_total', dep) / 2**20:.1f} MiB of KV moved")

        # Replica requests: which replica serves depends on the prompt's hash; send enough
        # distinct prompts that the remote one serves several.
        ok = True
        for i in range(12):
            p = f"Question {i * 31}: name a river."
            ok &= complete(gw, p, max_tokens=12, temperature=0) == complete(ref, p, max_tokens=12, temperature=0)
        served_remote = labelled(gw, "tessera_replica_requests_total", remote)
        check(ok and served_remote >= 2,
              f"gateway with a replica on the second host: 12 requests identical to colocated, "
              f"{served_remote:.0f} served across the link")

        # Cut the link while a greedy stream runs on the remote replica.
        long_prompt = None
        for i in range(40):
            candidate = f"Story {i}: tell a long tale about a lighthouse keeper."
            before = labelled(gw, "tessera_replica_requests_total", remote)
            complete(gw, candidate, max_tokens=1, temperature=0)
            if labelled(gw, "tessera_replica_requests_total", remote) > before:
                long_prompt = candidate
                break
        check(long_prompt is not None, "found a prompt the router sends to the second host")
        want_long = complete(ref, long_prompt, max_tokens=160, temperature=0, extra_body={"ignore_eos": True})[0]
        result, first = {}, threading.Event()

        def stream():
            text, times = [], []
            try:
                s = gw.openai_client(timeout=120).completions.create(model=MODEL, prompt=long_prompt, max_tokens=160,
                                                                     temperature=0, stream=True,
                                                                     extra_body={"ignore_eos": True})
                for chunk in s:
                    if chunk.choices and chunk.choices[0].text:
                        text.append(chunk.choices[0].text)
                        times.append(time.time())
                        first.set()
            except Exception as e:  # noqa: BLE001
                result["error"] = e
            result["text"] = "".join(text)
            result["gap"] = h.longest_gap(times)
            first.set()

        t = threading.Thread(target=stream)
        t.start()
        first.wait(60)
        time.sleep(0.2)
        cut_at = time.time()
        ns.link(False)
        check(h.wait_until(lambda: labelled(gw, "tessera_replica_healthy", remote) == 0, 10),
              f"link cut: the second host's replica is unhealthy after {time.time() - cut_at:.2f} s")
        t.join(180)
        resumed = labelled(gw, "tessera_replica_resumed_total", dep)
        check(not t.is_alive() and "error" not in result and result.get("text") == want_long,
              f"... the greedy stream continued on the gateway's engine, identical "
              f"({len(result.get('text', ''))} chars, resumed {resumed}, longest stall "
              f"{result.get('gap', 0):.2f} s)")
        local_before = labelled(gw, "tessera_replica_requests_total", f'{dep},replica="local"')
        check(complete(gw, long_prompt, max_tokens=8, temperature=0) ==
              complete(ref, long_prompt, max_tokens=8, temperature=0) and
              labelled(gw, "tessera_replica_requests_total", f'{dep},replica="local"') == local_before + 1,
              "... and new requests are served by the gateway's own engine meanwhile, identical")
        ns.link(True)
        check(h.wait_until(lambda: labelled(gw, "tessera_replica_healthy", remote) == 1, 15),
              "link back up: the replica is healthy again")
        check(replica.wait_for_metric("tessera_kv_blocks_used", 0, timeout=30),
              "the second host's replica uses no KV block afterwards")
    finally:
        for s in reversed(started):
            try:
                s.stop()
            except Exception:  # noqa: BLE001
                pass
        ns.delete()

    check.finish("second-host")


if __name__ == "__main__":
    try:
        main()
    finally:
        h.print_crash_reports()
