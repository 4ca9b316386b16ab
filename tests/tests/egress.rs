//! The guest's only way out, the egress proxy, end to end: secret injection (and the
//! secret never in the guest), policy, tunnelling, SSE, WebSocket, bad input; and the
//! loopback relays and published ports.
//!
//! The upstreams are test servers on the host's loopback with a test CA of their own;
//! the proxy is pointed at them only through `vmctl up`'s explicit test options.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use vm_tests::upstream::{self, TestCa};
use vm_tests::{assert_ok, random_hex, stdout, Workspace};

const PROBE: &str = include_str!("../guest/proxy_probe.py");

/// `vmctl secret set NAME ARGS`, the value on stdin; it must succeed.
fn set_secret(ws: &Workspace, name: &str, value: &str, args: &[&str]) {
    let output = ws.set_secret(name, args, Some(&format!("{value}\n")));
    assert_ok(&output, "vmctl secret set");
}

/// Runs the probe script in the guest (as root, to read every process's memory).
fn probe(ws: &Workspace, args: &str) -> String {
    let output = ws.exec_as_root(&format!("python3 proxy_probe.py {args}"));
    assert_ok(&output, &format!("proxy_probe.py {args}"));
    stdout(&output)
}

#[test]
fn the_guest_reaches_the_world_only_through_the_egress_proxy() {
    vm_tests::vm_scenario(
        "egress::the_guest_reaches_the_world_only_through_the_egress_proxy",
        egress_scenario,
    );
}

fn egress_scenario() {
    let ws = Workspace::new("egress");
    let ca = TestCa::new(&["api.anthropic.com", "plain.test", "y.both.test"]);
    let tls_upstream = upstream::start(Some(&ca));
    let http_upstream = upstream::start(None);
    let ca_file = ws.dir.join("test-ca.pem");
    std::fs::write(&ca_file, &ca.ca_pem).unwrap();
    std::fs::write(ws.path().join("test-ca.pem"), &ca.ca_pem).unwrap();
    std::fs::write(ws.path().join("proxy_probe.py"), PROBE).unwrap();

    let secret = format!("sk-ant-api03-{}", random_hex(24));
    set_secret(&ws, "anthropic", &secret, &[]);
    let listed = ws.run(&["secret", "ls"]);
    assert_ok(&listed, "vmctl secret ls");
    assert!(stdout(&listed).contains("anthropic") && !stdout(&listed).contains(&secret));
    for rule in [
        &["allow", "plain.test", "*.both.test", "localhost"][..],
        &["deny", "x.both.test"][..],
    ] {
        assert_ok(&ws.run(&[&["policy"], rule].concat()), "vmctl policy");
    }
    let tls = tls_upstream.addr.to_string();
    let http = http_upstream.addr.to_string();
    let resolve = [
        format!("api.anthropic.com:443={tls}"),
        format!("plain.test:443={tls}"),
        format!("y.both.test:80={http}"),
        format!("x.both.test:80={http}"),
    ];
    let mut up = vec!["up", "--egress-test-ca", ca_file.to_str().unwrap()];
    for entry in &resolve {
        up.extend(["--egress-test-resolve", entry]);
    }
    assert_ok(&ws.run(&up), "vmctl up");

    // The guest is set up for the proxy and holds a placeholder, not the key.
    let env = ws.exec("env");
    assert_ok(&env, "env");
    let env = stdout(&env);
    for expected in [
        "HTTPS_PROXY=http://127.0.0.1:3128",
        "https_proxy=http://127.0.0.1:3128",
        "NO_PROXY=localhost,127.0.0.1,::1",
        "NODE_USE_ENV_PROXY=1",
        "ANTHROPIC_API_KEY=",
        "SSL_CERT_FILE=",
    ] {
        assert!(env.contains(expected), "{expected} missing from {env}");
    }

    // curl and node reach the bound host; the upstream sees the real key, set by
    // the proxy over the guest's own value; the echo the guest gets back has none.
    let curl = ws.exec("curl -sS -H 'x-api-key: guest-sent' https://api.anthropic.com/v1/curl");
    assert_ok(&curl, "curl through the proxy");
    let node = ws.exec(
        "node -e \"fetch('https://api.anthropic.com/v1/node').then(r => r.text()).then(t => console.log(t))\"",
    );
    assert_ok(&node, "node fetch through the proxy");
    let node_stderr = String::from_utf8_lossy(&node.stderr);
    assert!(
        !node_stderr.contains("Warning"),
        "noise on stderr: {node_stderr}"
    );
    for (client, output) in [("curl", &curl), ("node", &node)] {
        let text = stdout(output);
        assert!(text.contains(&format!("/v1/{client}")), "{client}: {text}");
        assert!(
            !text.contains(&secret),
            "{client} saw the secret in the echo"
        );
        let seen = tls_upstream.seen.requests();
        let request = seen
            .iter()
            .find(|r| r.contains(&format!("/v1/{client}")))
            .unwrap_or_else(|| panic!("the upstream never saw {client}'s request"));
        assert!(
            request
                .to_ascii_lowercase()
                .contains(&format!("x-api-key: {}", secret.to_ascii_lowercase())),
            "no injected key in {request}"
        );
        assert!(!request.contains("guest-sent"));
    }

    // An allowed host without a secret is tunnelled: the guest sees the upstream's
    // own certificate (the test CA, not the sandbox's) and no key goes out.
    let tunnel = ws.exec("curl -sS --cacert test-ca.pem https://plain.test/unbound");
    assert_ok(&tunnel, "curl to an unbound host");
    assert!(stdout(&tunnel).contains("GET /unbound"));
    assert!(!stdout(&tunnel).to_ascii_lowercase().contains("x-api-key"));
    // The guest trusts what the proxy trusts upstream (here the test CA, as a
    // TLS-inspecting company proxy's CA the host trusts would be): curl through the
    // system bundle and node through NODE_EXTRA_CA_CERTS, no --cacert.
    let trusted = ws.exec("curl -sS https://plain.test/curl-trusts");
    assert_ok(
        &trusted,
        "curl to an unbound host with the guest's own trust",
    );
    assert!(stdout(&trusted).contains("GET /curl-trusts"));
    let node_trusted = ws.exec(
        "node -e \"fetch('https://plain.test/node-trusts').then(r => r.text()).then(t => console.log(t))\"",
    );
    assert_ok(&node_trusted, "node fetch to an unbound host");
    assert!(stdout(&node_trusted).contains("GET /node-trusts"));

    // A Host header that disagrees with the CONNECT target is refused.
    let mismatch = ws.exec(
        "curl -s -o /dev/null -w '%{http_code}' -H 'Host: plain.test' https://api.anthropic.com/v1/mismatch",
    );
    assert_eq!(stdout(&mismatch), "403");
    assert!(!tls_upstream
        .seen
        .requests()
        .iter()
        .any(|r| r.contains("/v1/mismatch")));

    // Policy: allowed, not allowed, deny over allow, a name that resolves to loopback.
    let allowed = ws.exec("curl -sS http://y.both.test/allowed");
    assert!(
        stdout(&allowed).contains("GET /allowed"),
        "{}",
        stdout(&allowed)
    );
    let not_allowed = probe(
        &ws,
        "raw 'CONNECT denied.test:443 HTTP/1.1\\r\\nHost: denied.test:443\\r\\n\\r\\n'",
    );
    assert!(not_allowed.starts_with("HTTP/1.1 403"), "{not_allowed}");
    assert!(not_allowed.contains("no allow rule"), "{not_allowed}");
    let denied = ws.exec("curl -sS http://x.both.test/denied");
    assert!(
        stdout(&denied).contains("deny x.both.test"),
        "{}",
        stdout(&denied)
    );
    let loopback = probe(
        &ws,
        "raw 'CONNECT localhost:443 HTTP/1.1\\r\\nHost: localhost:443\\r\\n\\r\\n'",
    );
    assert!(loopback.starts_with("HTTP/1.1 403"), "{loopback}");
    assert!(loopback.contains("loopback"), "{loopback}");
    let log = ws.run(&["policy", "log"]);
    assert_ok(&log, "vmctl policy log");
    assert!(stdout(&log).contains("denied.test"), "{}", stdout(&log));

    // Server-sent events arrive as they are sent (one second apart), not at the end.
    let events = probe(&ws, "sse");
    let times: Vec<f64> = events
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    assert_eq!(times.len(), 3, "{events}");
    assert!(times[2] - times[0] > 1.2, "events bunched up: {events}");

    // A WebSocket upgrade through the TLS-terminating path.
    let ws_echo = probe(&ws, "ws");
    assert!(
        ws_echo.contains("101") && ws_echo.contains("websocket echo ok"),
        "{ws_echo}"
    );

    // Bad input gets a clear answer.
    let garbage = probe(&ws, "raw 'NONSENSE\\r\\n\\r\\n'");
    assert!(garbage.starts_with("HTTP/1.1 400"), "{garbage}");

    // Nothing in the guest holds the secret: environments, command lines, memory of
    // every process, and the files written since boot. First, the search must find
    // a canary that a guest process does hold.
    let canary = random_hex(24);
    assert_ok(
        &ws.exec(&format!(
            "VMCTL_CANARY={canary} setsid sleep 600 </dev/null >/dev/null 2>&1 &"
        )),
        "start the canary",
    );
    let found = search_guest(&ws, &canary);
    assert!(
        found.contains("FOUND") && found.contains("environ") && found.contains("memory of pid"),
        "the search missed the canary: {found}"
    );
    let scan = search_guest(&ws, &secret);
    assert!(scan.contains("CLEAN"), "{scan}");
}

/// Searches the guest for `needle`, which the guest is only given masked.
fn search_guest(ws: &Workspace, needle: &str) -> String {
    let mask = vm_tests::random_bytes(needle.len());
    let masked: Vec<u8> = needle.bytes().zip(&mask).map(|(s, m)| s ^ m).collect();
    probe(ws, &format!("scan {} {}", hex(&mask), hex(&masked)))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn loopback_ports_are_relayed_and_published() {
    vm_tests::vm_scenario(
        "egress::loopback_ports_are_relayed_and_published",
        relay_scenario,
    );
}

fn relay_scenario() {
    let ws = Workspace::new("relay");
    let host_server = upstream::start(None);
    let port = host_server.addr.port().to_string();
    assert_ok(&ws.run(&["up", "--relay-port", &port]), "vmctl up");

    // Guest 127.0.0.1:P reaches the host's 127.0.0.1:P.
    let relayed = ws.exec(&format!("curl -sS http://127.0.0.1:{port}/relayed"));
    assert_ok(&relayed, "curl to a relayed port");
    assert!(stdout(&relayed).contains("GET /relayed"));

    // A server on the guest's loopback, published on the host.
    assert_ok(
        &ws.exec(
            "mkdir -p /tmp/site && echo published-ok > /tmp/site/index.html && \
             setsid python3 -m http.server --bind 127.0.0.1 --directory /tmp/site 8123 \
             </dev/null >/dev/null 2>&1 &",
        ),
        "start a guest server",
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let ports = loop {
        let ports = stdout(&ws.run(&["ports"]));
        if ports.lines().any(|l| l.starts_with("8123 ")) || Instant::now() > deadline {
            break ports;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(
        ports
            .lines()
            .any(|l| l.starts_with("8123 ") && l.contains("127.0.0.1")),
        "{ports}"
    );
    assert!(
        ports.lines().any(|l| l.starts_with("6767 ")),
        "Paseo's port is not relayed: {ports}"
    );

    let published = ws.run(&["publish", "8123"]);
    assert_ok(&published, "vmctl publish");
    let address = stdout(&published).trim().to_string();
    let body = http_get(&address, "/index.html");
    assert!(body.contains("published-ok"), "{body}");
    assert!(stdout(&ws.run(&["ports"])).contains(&address));
    let again = ws.run(&["publish", "8123"]);
    assert_ok(&again, "vmctl publish of a published port");
    assert_eq!(stdout(&again).trim(), address, "published again elsewhere");

    // A client that half-closes (sends its request, then shuts down its sending side,
    // as `nc -N` does) still gets the answer the guest sends after reading to EOF.
    assert_ok(
        &ws.exec(&format!(
            "setsid python3 -c '{COUNTING_SERVER}' 8124 </dev/null >/dev/null 2>&1 &"
        )),
        "start a guest server that answers after EOF",
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while !stdout(&ws.run(&["ports"]))
        .lines()
        .any(|l| l.starts_with("8124 "))
    {
        assert!(
            Instant::now() < deadline,
            "the counting server never listened"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let published = ws.run(&["publish", "8124"]);
    assert_ok(&published, "vmctl publish 8124");
    let counting = stdout(&published).trim().to_string();
    let request = vm_tests::random_bytes(300 * 1024);
    let mut stream = TcpStream::connect(&counting).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    stream.write_all(&request).unwrap();
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answer = String::new();
    let read = stream.read_to_string(&mut answer);
    assert_eq!(
        answer,
        format!("got {} bytes\n", request.len()),
        "the answer after a half close ({read:?})"
    );

    assert_ok(&ws.run(&["unpublish", "8123"]), "vmctl unpublish");
    assert!(
        TcpStream::connect(&address).is_err(),
        "{address} still accepts connections"
    );
}

/// A guest TCP server on 127.0.0.1:argv[1] that reads each connection to EOF, then
/// answers with how many bytes it read (Python, no single quotes).
const COUNTING_SERVER: &str = "
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((\"127.0.0.1\", int(sys.argv[1])))
server.listen()
while True:
    conn, _ = server.accept()
    total = 0
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            break
        total += len(chunk)
    conn.sendall(b\"got %d bytes\\n\" % total)
    conn.close()
";

/// A plain HTTP/1.0 GET on the host; returns the whole response.
fn http_get(address: &str, path: &str) -> String {
    let mut stream = TcpStream::connect(address).unwrap_or_else(|e| panic!("{address}: {e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n").unwrap();
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response
}
