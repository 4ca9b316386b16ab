//! The egress path, guest against host: latency and throughput of HTTP(S) requests
//! from the guest through its only way out (the guest agent's proxy on
//! 127.0.0.1:3128, vsock, the host-side egress proxy in vmctl's supervisor) against
//! the same requests made directly from the host, in one run.
//!
//! The upstreams are test servers on the host's loopback in this process
//! (`vm_tests::upstream`): plain HTTP, and HTTPS with a test CA for [`HOST_NAME`].
//! The proxy reaches them through `vmctl up`'s test options; a secret bound to the
//! host makes the HTTPS path the TLS-terminating, header-injecting one. Every
//! figure is measured with `curl -w` (curl times its own transfers, so neither
//! `vmctl exec` nor curl's start is counted). See `benches/README.md`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vm_tests::upstream::{self, TestCa, Upstream};

use crate::boot::{say, TempDir};
use crate::process::{run_command, Ran};
use crate::report::{guest_slowdown, Better, Figure, GUEST, HOST};
use crate::scan::tail;
use crate::workspace::{GuestArtifacts, Vmctl};

/// Where a request is made: on the host, or in the guest through its egress proxy.
/// (Its own type: the virtio-fs section's [`crate::fs::Side`] has a third side.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Host,
    Guest,
}

impl Side {
    pub fn label(self) -> &'static str {
        match self {
            Side::Host => HOST,
            Side::Guest => GUEST,
        }
    }
}

/// Both sides, alternating which goes first.
pub fn order(call: usize) -> [Side; 2] {
    if call.is_multiple_of(2) {
        [Side::Host, Side::Guest]
    } else {
        [Side::Guest, Side::Host]
    }
}

/// The upstreams' name: the policy allows it, the secret is bound to it, and
/// `--egress-test-resolve` points its ports 80 and 443 at the upstreams.
pub const HOST_NAME: &str = "bench.test";
pub const SECRET_NAME: &str = "bench";
/// Requests per curl call for the latency figures, and curl calls per side.
pub const LATENCY_REQUESTS: usize = 50;
pub const QUICK_LATENCY_REQUESTS: usize = 10;
pub const LATENCY_ROUNDS: usize = 2;
/// The throughput download's size and how many per side.
pub const THROUGHPUT_MIB: u64 = 64;
pub const QUICK_THROUGHPUT_MIB: u64 = 16;
pub const THROUGHPUT_RUNS: usize = 3;
pub const QUICK_THROUGHPUT_RUNS: usize = 2;
/// Per curl call (the guest's run through emulation in the nested host).
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(300);
/// curl calls per run besides the measured ones: two `--version`, four probes.
pub const UNMEASURED_CALLS: usize = 6;

/// `-w` of the latency calls: one line per URL.
const LATENCY_FORMAT: &str = r"%{http_code} %{time_total} %{num_connects}\n";
/// `-w` of the throughput calls: speed in bytes per second.
const THROUGHPUT_FORMAT: &str = r"%{http_code} %{size_download} %{speed_download} %{time_total}\n";

const NOTE_NESTED: &str = "Nested: the host side is the QEMU-TCG nested host, where the VMM, its \
supervisor's egress proxy and the upstreams run; the guest side is one emulation level deeper \
(the guest runs under KVM emulated by TCG). Absolute figures are TCG-emulated; the guest/host \
ratios carry that extra level as well as the egress path itself.";
const NOTE_DIRECT: &str = "Direct: the host side is this machine, where the VMM, its supervisor's \
egress proxy and the upstreams run on hardware KVM.";

/// The sizes one run measures.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressSizes {
    /// URLs per curl call, and calls per side, for each latency figure.
    pub latency_requests: usize,
    pub latency_rounds: usize,
    /// The throughput download and how many per side.
    pub throughput_mib: u64,
    pub throughput_runs: usize,
}

pub fn sizes(quick: bool) -> EgressSizes {
    EgressSizes {
        latency_requests: if quick {
            QUICK_LATENCY_REQUESTS
        } else {
            LATENCY_REQUESTS
        },
        latency_rounds: LATENCY_ROUNDS,
        throughput_mib: if quick {
            QUICK_THROUGHPUT_MIB
        } else {
            THROUGHPUT_MIB
        },
        throughput_runs: if quick {
            QUICK_THROUGHPUT_RUNS
        } else {
            THROUGHPUT_RUNS
        },
    }
}

impl EgressSizes {
    /// The curl calls a run makes, measured or not (for the nested run's time limit).
    pub fn calls(&self) -> usize {
        UNMEASURED_CALLS + 2 * (2 * self.latency_rounds + self.throughput_runs)
    }
}

/// What to measure and with what.
#[derive(Debug, Clone)]
pub struct EgressBench {
    /// vmctl and the guest it boots.
    pub artifacts: GuestArtifacts,
    pub sizes: EgressSizes,
    /// Per `vmctl up` / `rm` / `policy` / `secret`.
    pub timeout: Duration,
    /// Per curl call.
    pub command_timeout: Duration,
    /// The benchmark runs inside the nested host.
    pub nested: bool,
    /// The host side's curl (`curl` from PATH; the tests' is a fake).
    pub curl: PathBuf,
}

/// One figure, guest and host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    LatencyHttp,
    LatencyHttps,
    Throughput,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::LatencyHttp, Kind::LatencyHttps, Kind::Throughput];

    pub fn name(self) -> &'static str {
        match self {
            Kind::LatencyHttp => "egress_latency_http_ms",
            Kind::LatencyHttps => "egress_latency_https_ms",
            Kind::Throughput => "egress_throughput_http_mib_s",
        }
    }

    pub fn unit(self) -> &'static str {
        match self {
            Kind::Throughput => "MiB/s",
            _ => "ms",
        }
    }

    pub fn better(self) -> Better {
        match self {
            Kind::Throughput => Better::Higher,
            _ => Better::Lower,
        }
    }

    fn https(self) -> bool {
        self == Kind::LatencyHttps
    }

    /// Curl calls per side.
    fn calls(self, s: &EgressSizes) -> usize {
        match self {
            Kind::Throughput => s.throughput_runs,
            _ => s.latency_rounds,
        }
    }
}

/// One request's `%{http_code} %{time_total} %{num_connects}`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Transfer {
    pub code: u16,
    pub secs: f64,
    pub connects: u64,
}

/// A download's `%{http_code} %{size_download} %{speed_download} %{time_total}`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Download {
    pub code: u16,
    pub bytes: u64,
    pub bytes_per_s: f64,
    pub secs: f64,
}

/// A non-negative, finite number of curl's (a decimal comma is accepted too).
fn number(v: &str, what: &str) -> Result<f64, String> {
    match v.replace(',', ".").parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!("{what} {v:?} is not a non-negative number")),
    }
}

fn fields(line: &str, n: usize) -> Result<Vec<&str>, String> {
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() != n {
        return Err(format!("{line:?}: expected {n} fields"));
    }
    Ok(f)
}

fn status(v: &str) -> Result<u16, String> {
    match v.parse::<u16>() {
        Ok(200) => Ok(200),
        Ok(code) => Err(format!("HTTP status {code}, expected 200")),
        Err(_) => Err(format!("status {v:?} is not a number")),
    }
}

/// The latency calls' output: `expected` lines of `LATENCY_FORMAT`, each 200.
pub fn parse_latency(out: &str, expected: usize) -> Result<Vec<Transfer>, String> {
    let lines: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.len() != expected {
        return Err(format!(
            "curl printed {} line(s), expected {expected} (one per URL)",
            lines.len()
        ));
    }
    lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let at = |e: String| format!("request {}: {e}", i + 1);
            let f = fields(line, 3).map_err(at)?;
            Ok(Transfer {
                code: status(f[0]).map_err(at)?,
                secs: number(f[1], "time_total").map_err(at)?,
                connects: f[2]
                    .parse()
                    .map_err(|_| at(format!("num_connects {:?} is not a number", f[2])))?,
            })
        })
        .collect()
}

/// The throughput call's output: one line of `THROUGHPUT_FORMAT`, 200, all
/// `expected_bytes` downloaded, at a positive speed.
pub fn parse_download(out: &str, expected_bytes: u64) -> Result<Download, String> {
    let lines: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
    let [line] = lines[..] else {
        return Err(format!("curl printed {} line(s), expected 1", lines.len()));
    };
    let f = fields(line, 4)?;
    let d = Download {
        code: status(f[0])?,
        bytes: f[1]
            .parse()
            .map_err(|_| format!("size_download {:?} is not a number", f[1]))?,
        bytes_per_s: number(f[2], "speed_download")?,
        secs: number(f[3], "time_total")?,
    };
    if d.bytes != expected_bytes {
        return Err(format!(
            "downloaded {} bytes, expected {expected_bytes}",
            d.bytes
        ));
    }
    if d.bytes_per_s <= 0.0 {
        return Err("speed_download is 0".into());
    }
    Ok(d)
}

/// Where the upstreams are and what the host side needs to reach them directly.
#[derive(Debug, Clone)]
pub struct Targets {
    pub http_port: u16,
    pub https_port: u16,
    pub ca_file: PathBuf,
    pub secret: String,
}

/// The curl command of `kind` on `side` (without `vmctl exec` for the guest):
/// `count` URLs with path `path` (latency), or one download of `bytes`. The host
/// side goes straight to the upstream (`--connect-to`: the URL, and so the Host
/// header and the TLS name, stay the guest's; `--noproxy '*'`) and, for
/// HTTPS, trusts the test CA and sends the header the proxy would inject; the guest
/// side has the proxy variables and the sandbox CA of `vmctl exec`.
pub fn curl_args(
    kind: Kind,
    side: Side,
    t: &Targets,
    path: &str,
    count: usize,
    bytes: u64,
) -> Vec<String> {
    let mut v: Vec<String> = vec!["-sS".into()];
    if side == Side::Host {
        v.extend(["--noproxy".into(), "*".into(), "--connect-to".into()]);
        v.push(if kind.https() {
            format!("{HOST_NAME}:443:127.0.0.1:{}", t.https_port)
        } else {
            format!("{HOST_NAME}:80:127.0.0.1:{}", t.http_port)
        });
        if kind.https() {
            v.extend([
                "--cacert".into(),
                t.ca_file.display().to_string(),
                "-H".into(),
                format!("Authorization: Bearer {}", t.secret),
            ]);
        }
    }
    let scheme = if kind.https() { "https" } else { "http" };
    match kind {
        Kind::Throughput => {
            v.extend(["-w".into(), THROUGHPUT_FORMAT.into(), "-o".into()]);
            v.push("/dev/null".into());
            v.push(format!("{scheme}://{HOST_NAME}/bytes/{bytes}"));
        }
        _ => {
            v.extend(["-w".into(), LATENCY_FORMAT.into()]);
            // Each URL needs its own -o, or the bodies after the first go to stdout.
            for _ in 0..count {
                v.extend(["-o".into(), "/dev/null".into()]);
                v.push(format!("{scheme}://{HOST_NAME}{path}"));
            }
        }
    }
    v
}

/// One egress figure: both sides' samples, the guest's slowdown, and for latencies
/// the added time.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EgressFigure {
    pub name: String,
    pub unit: String,
    pub better: Better,
    /// Latency: URLs per curl call; throughput: the download's MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_call: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_mib: Option<u64>,
    /// `vmm` is "host" or "guest"; `None` when no sample was measured.
    pub host: Option<Figure>,
    pub guest: Option<Figure>,
    /// Above 1 the guest is slower (guest/host for times, host/guest for throughputs).
    pub guest_slowdown: Option<f64>,
    /// Latency only: guest median - host median, in ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub added_ms: Option<f64>,
    /// Latency only: the new connections curl opened (`num_connects`, summed), per side.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_connects: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_connects: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl EgressFigure {
    pub fn new(
        kind: Kind,
        s: &EgressSizes,
        [host, guest]: [Vec<f64>; 2],
        connects: [u64; 2],
        mut error: Option<String>,
    ) -> EgressFigure {
        let (name, unit) = (kind.name(), kind.unit());
        let counts = (host.len(), guest.len());
        let host = Figure::new(name, unit, HOST, host);
        let guest = Figure::new(name, unit, GUEST, guest);
        if error.is_none() && (host.is_none() || guest.is_none()) {
            error = Some(format!(
                "no valid samples (host: {}, guest: {} taken)",
                counts.0, counts.1
            ));
        }
        let medians = match (&host, &guest, &error) {
            (Some(h), Some(g), None) => Some((h.median, g.median)),
            _ => None,
        };
        let latency = kind != Kind::Throughput;
        EgressFigure {
            name: name.into(),
            unit: unit.into(),
            better: kind.better(),
            requests_per_call: latency.then_some(s.latency_requests),
            size_mib: (!latency).then_some(s.throughput_mib),
            host,
            guest,
            guest_slowdown: medians.and_then(|(h, g)| guest_slowdown(h, g, kind.better())),
            added_ms: medians.filter(|_| latency).map(|(h, g)| g - h),
            host_connects: latency.then_some(connects[0]),
            guest_connects: latency.then_some(connects[1]),
            error,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EgressConfig {
    pub sizes: EgressSizes,
    pub host_name: String,
    /// The upstreams on the host's loopback.
    pub upstream_http: String,
    pub upstream_https: String,
    pub timeout_s: u64,
    pub command_timeout_s: u64,
    pub workspace: String,
    /// As `vmctl up` recorded them in the VM's `vm.json`.
    pub vm_cpus: u64,
    pub vm_memory_mib: u64,
    pub vm_nested: bool,
    /// `curl --version`, first line, of each side.
    pub curl_host: String,
    pub curl_guest: String,
}

/// The egress path, guest against host.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EgressReport {
    pub note: String,
    /// Where the host side ran (where the VMM, the proxy and the upstreams run).
    pub host: String,
    pub nested: bool,
    pub config: EgressConfig,
    /// The setup commands and each figure's curl command per side (first call).
    pub commands: Vec<(String, Vec<String>)>,
    pub environment: Vec<(String, String)>,
    pub figures: Vec<EgressFigure>,
    pub notes: Vec<String>,
    /// The section failed as a whole (setup, `vmctl up`, a probe, `vmctl rm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

use crate::report::fmt_sig;

impl EgressReport {
    /// Every error: the section's and each figure's, as (what, message).
    pub fn errors(&self) -> Vec<(String, String)> {
        let figures = self.figures.iter().map(|f| (&f.name, &f.error));
        crate::report::section_errors("egress", &self.error, figures)
    }

    pub fn markdown(&self) -> String {
        let c = &self.config;
        let z = &c.sizes;
        let mut s = format!(
            "Egress path (VM of `vmctl up`: {} vCPUs, {} MiB): requests from the guest through \
             its proxy (guest agent on 127.0.0.1:3128, vsock, the egress proxy in vmctl's \
             supervisor) against the same requests from the host ({}) straight to the upstreams \
             (test servers on its loopback, one request per connection). Guest: `vmctl exec -- \
             curl URL...` with the proxy variables it sets; host: `curl --noproxy '*' --connect-to \
             {h}:PORT:127.0.0.1:P URL...`. Latency: `curl -w '%{{http_code}} %{{time_total}} \
             %{{num_connects}}\\n'`, {} URLs per curl call, {} calls per side; HTTPS: the \
             secret `{SECRET_NAME}` is bound to {h}, so the proxy terminates TLS (sandbox CA) \
             and injects `Authorization: Bearer` (the host sends the same header itself, \
             `--cacert` the test CA). Throughput: `curl -w '%{{speed_download}}' -o /dev/null \
             http://{h}/bytes/N`, {} MiB, {} downloads per side. Sides alternate which goes \
             first; curl times its transfers, so `vmctl exec` is not \
             counted. Slowdown: above 1 the guest is slower. {}\n\n",
            c.vm_cpus,
            c.vm_memory_mib,
            self.host,
            z.latency_requests,
            z.latency_rounds,
            z.throughput_mib,
            z.throughput_runs,
            self.note,
            h = c.host_name,
        );
        if let Some(e) = &self.error {
            s.push_str(&format!(
                "**Error:** {}\n\n",
                e.lines().next().unwrap_or("")
            ));
        }
        if self.figures.is_empty() {
            return s;
        }
        s.push_str(
            "| figure | unit | host median | guest median | host p90 | guest p90 | host min–max \
             | guest min–max | n | added (guest − host) | guest slowdown |\n",
        );
        s.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        let get = |f: &Option<Figure>, g: &dyn Fn(&Figure) -> String| {
            f.as_ref().map_or("–".to_string(), g)
        };
        let median = |f: &Figure| fmt_sig(f.median);
        let p90 = |f: &Figure| fmt_sig(f.p90);
        let range = |f: &Figure| format!("{}–{}", fmt_sig(f.min), fmt_sig(f.max));
        let n = |f: &Option<Figure>| f.as_ref().map_or(0, |f| f.samples.len());
        for f in &self.figures {
            let (added, slowdown) = match (&f.error, f.added_ms, f.guest_slowdown) {
                (Some(_), _, _) => ("error".to_string(), "error".to_string()),
                (None, a, r) => (
                    a.map_or("–".into(), |a| format!("{} ms", fmt_sig(a))),
                    r.map_or("–".into(), |r| format!("{r:.2}x")),
                ),
            };
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                f.name,
                f.unit,
                get(&f.host, &median),
                get(&f.guest, &median),
                get(&f.host, &p90),
                get(&f.guest, &p90),
                get(&f.host, &range),
                get(&f.guest, &range),
                if n(&f.host) == n(&f.guest) {
                    n(&f.host).to_string()
                } else {
                    format!("{}/{}", n(&f.host), n(&f.guest))
                },
                added,
                slowdown
            ));
        }
        for f in self.figures.iter().filter(|f| f.error.is_some()) {
            let e = f.error.as_deref().unwrap_or("");
            s.push_str(&format!(
                "\n**{} error:** {} (full message in the JSON report)\n",
                f.name,
                e.lines().next().unwrap_or("")
            ));
        }
        for n in &self.notes {
            s.push_str(&format!("\n{n}\n"));
        }
        s
    }
}

/// The two places curl runs.
struct Runner<'a> {
    vmctl: &'a Vmctl,
    curl: &'a Path,
    workspace: &'a Path,
    timeout: Duration,
}

impl Runner<'_> {
    fn argv(&self, side: Side, args: Vec<String>) -> Vec<String> {
        let mut v = Vec::new();
        match side {
            Side::Host => v.push(self.curl.display().to_string()),
            Side::Guest => v.extend(self.vmctl.exec_argv(self.workspace, None, &["curl"])),
        }
        v.extend(args);
        v
    }

    /// Runs curl with `args` on `side`; exit 0 required. The error carries curl's
    /// output (and, for the guest, the VM's logs).
    fn run(&self, side: Side, what: &str, args: Vec<String>) -> Result<Ran, String> {
        let argv = self.argv(side, args);
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..]).current_dir(self.workspace);
        if side == Side::Guest {
            cmd.envs(self.vmctl.env.iter().map(|(k, v)| (k, v)));
        }
        let line = format!("{what} ({}: {})", side.label(), argv.join(" "));
        let logs = || match side {
            Side::Guest => self.vmctl.logs(),
            Side::Host => String::new(),
        };
        let ran = run_command(cmd, &line, self.timeout, side == Side::Host)
            .map_err(|e| format!("{e}{}", logs()))?;
        if !ran.status.success() {
            return Err(format!(
                "{line} failed ({})\n--- stderr (tail) ---\n{}\n--- stdout (tail) ---\n{}{}",
                ran.status,
                tail(&ran.stderr, 3000),
                tail(&ran.stdout, 1500),
                logs()
            ));
        }
        Ok(ran)
    }
}

/// The host path of `vmctl`'s config for this run: policy and secrets go beside it.
fn config_file(tmp: &Path) -> PathBuf {
    tmp.join("config").join("config.toml")
}

/// Measures the egress figures. Never fails as a whole: a section-wide failure is
/// the report's `error`, a figure's failure is its `error`.
pub fn measure(b: &EgressBench) -> EgressReport {
    let mut report = EgressReport {
        note: if b.nested { NOTE_NESTED } else { NOTE_DIRECT }.into(),
        host: if b.nested {
            "the QEMU-TCG nested host, where the VMM runs".into()
        } else {
            "this machine, where the VMM runs".into()
        },
        nested: b.nested,
        config: EgressConfig {
            sizes: b.sizes.clone(),
            host_name: HOST_NAME.into(),
            upstream_http: String::new(),
            upstream_https: String::new(),
            timeout_s: b.timeout.as_secs(),
            command_timeout_s: b.command_timeout.as_secs(),
            workspace: String::new(),
            vm_cpus: 0,
            vm_memory_mib: 0,
            vm_nested: false,
            curl_host: String::new(),
            curl_guest: String::new(),
        },
        commands: Vec::new(),
        environment: Vec::new(),
        figures: Vec::new(),
        notes: Vec::new(),
        error: None,
    };
    // A panic (a test server that cannot start, say) must not end the benchmark.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        measure_into(b, &mut report)
    }))
    .unwrap_or_else(|panic| {
        let why = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("unknown panic");
        Err(format!("panicked: {why}"))
    });
    if let Err(e) = result {
        say(format!("error: egress: {e}"));
        report.error = Some(e);
    }
    report
}

/// Makes sure 127.0.0.1 can be bound, for the upstreams.
fn loopback() -> Result<(), String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .map(drop)
        .map_err(|e| format!("cannot bind 127.0.0.1 for the upstreams: {e}"))
}

fn measure_into(b: &EgressBench, report: &mut EgressReport) -> Result<(), String> {
    let s = &b.sizes;
    if s.latency_requests == 0 || s.latency_rounds == 0 || s.throughput_mib == 0 {
        return Err("the egress sizes must be at least 1".into());
    }
    let tmp = TempDir::unique("-egress");
    let state = tmp.0.join("state");
    let ws = tmp.0.join("ws");
    let config = config_file(&tmp.0);
    for d in [&state, &ws, &tmp.0.join("config")] {
        fs::create_dir_all(d).map_err(|e| format!("create {}: {e}", d.display()))?;
    }
    let ws = ws
        .canonicalize()
        .map_err(|e| format!("{}: {e}", ws.display()))?;

    // The upstreams, in this process, on the loopback of where the proxy runs.
    loopback()?;
    let ca = TestCa::new(&[HOST_NAME]);
    let ca_file = tmp.0.join("upstream-ca.pem");
    fs::write(&ca_file, &ca.ca_pem).map_err(|e| format!("write {}: {e}", ca_file.display()))?;
    let http: Upstream = upstream::start(None);
    let https: Upstream = upstream::start(Some(&ca));
    report.config.upstream_http = http.addr.to_string();
    report.config.upstream_https = https.addr.to_string();
    let targets = Targets {
        http_port: http.addr.port(),
        https_port: https.addr.port(),
        ca_file: ca_file.clone(),
        secret: format!("bench-secret-{}", vm_tests::random_hex(24)),
    };

    // Declared after `tmp`, so dropped (the VM removed) before the directory goes.
    let mut vmctl = Vmctl::new(&b.artifacts, state, Some(&config), b.timeout);
    report.environment = vmctl.env.clone();
    report.config.workspace = ws.display().to_string();
    let bin = b.artifacts.vmctl.display().to_string();
    let policy: Vec<String> = [bin.as_str(), "policy", "allow", HOST_NAME, "--global"]
        .map(String::from)
        .to_vec();
    vmctl
        .run_ok(&policy)
        .map_err(|e| format!("vmctl policy: {e}"))?;
    // The value on stdin (never on a command line), from the environment of `sh`.
    let secret_cmd = format!(
        "printf '%s\\n' \"$BENCH_SECRET\" | \"$0\" secret set {SECRET_NAME} --host {HOST_NAME}"
    );
    let mut cmd = Command::new("sh");
    cmd.args(["-c", &secret_cmd, &bin])
        .envs(vmctl.env.iter().map(|(k, v)| (k, v)))
        .env("BENCH_SECRET", &targets.secret);
    let line = format!("vmctl secret set {SECRET_NAME} --host {HOST_NAME}");
    let ran = run_command(cmd, &line, b.timeout, false)?;
    if !ran.status.success() {
        return Err(format!(
            "{line} failed ({})\n--- stderr (tail) ---\n{}",
            ran.status,
            tail(&ran.stderr, 2000)
        ));
    }

    let ca_arg = ca_file.display().to_string();
    let resolve = [
        format!("{HOST_NAME}:80={}", http.addr),
        format!("{HOST_NAME}:443={}", https.addr),
    ];
    let mut up_args = vec!["up", "--egress-test-ca", ca_arg.as_str()];
    for r in &resolve {
        up_args.extend(["--egress-test-resolve", r.as_str()]);
    }
    let up_argv = vmctl.argv(&up_args, &ws);
    say(format!(
        "egress: {} x {} requests per side and protocol, {} x {} MiB download per side, in {}",
        s.latency_rounds,
        s.latency_requests,
        s.throughput_runs,
        s.throughput_mib,
        ws.display()
    ));
    vmctl.live.push(ws.clone());
    let up = vmctl
        .run_ok(&up_argv)
        .map_err(|e| format!("vmctl up: {e}"))?;
    let (_, record) = vmctl.vm_dir(&ws)?;
    report.config.vm_cpus = record["cpus"].as_u64().unwrap_or(0);
    report.config.vm_memory_mib = record["memory_mib"].as_u64().unwrap_or(0);
    report.config.vm_nested = record["nested"].as_bool().unwrap_or(false);
    say(format!(
        "egress: VM up in {:.1} s",
        up.elapsed.as_secs_f64()
    ));
    if report.config.vm_nested {
        report.notes.push(
            "vmctl up ran the VM in a nested host of its own: the guest side is one more level \
             of emulation deeper than the host side."
                .into(),
        );
    }

    let runner = Runner {
        vmctl: &vmctl,
        curl: &b.curl,
        workspace: &ws,
        timeout: b.command_timeout,
    };
    report.commands = vec![
        ("policy".into(), policy),
        (
            "secret".into(),
            vec!["sh".into(), "-c".into(), secret_cmd.clone(), bin.clone()],
        ),
        ("up".into(), up_argv),
    ];
    for kind in Kind::ALL {
        for side in [Side::Host, Side::Guest] {
            let args = curl_args(
                kind,
                side,
                &targets,
                "/latency",
                s.latency_requests,
                s.throughput_mib << 20,
            );
            let mut argv = runner.argv(side, args);
            if kind.https() && side == Side::Host {
                // The report does not carry the secret.
                for a in &mut argv {
                    if a.starts_with("Authorization: Bearer ") {
                        *a = "Authorization: Bearer SECRET".into();
                    }
                }
            }
            report
                .commands
                .push((format!("{} ({})", kind.name(), side.label()), argv));
        }
    }
    report
        .commands
        .push(("rm".into(), vmctl.argv(&["rm"], &ws)));

    // Untimed: each side's curl, and one request per protocol and side that must
    // reach the upstream (the guest's HTTPS one with the secret injected).
    let version = |side: Side| {
        runner
            .run(side, "curl --version", vec!["--version".into()])
            .map(|r| crate::report::first_line(&r.stdout).to_string())
    };
    report.config.curl_host = version(Side::Host)?;
    report.config.curl_guest = version(Side::Guest)?;
    for kind in [Kind::LatencyHttp, Kind::LatencyHttps] {
        for side in [Side::Host, Side::Guest] {
            let path = format!("/probe-{}", side.label());
            let what = format!("probe {}", kind.name());
            let ran = runner.run(side, &what, curl_args(kind, side, &targets, &path, 1, 0))?;
            parse_latency(&ran.stdout, 1).map_err(|e| format!("{what} ({}): {e}", side.label()))?;
            let upstream = if kind.https() { &https } else { &http };
            let seen = upstream.seen.requests();
            let request = seen
                .iter()
                .rev()
                .find(|r| r.lines().next().is_some_and(|l| l.contains(&path)))
                .ok_or_else(|| {
                    format!(
                        "{what} ({}): the upstream never saw the request for {path}",
                        side.label()
                    )
                })?;
            let header = format!("authorization: bearer {}", targets.secret).to_lowercase();
            if kind.https() && !request.to_lowercase().contains(&header) {
                return Err(format!(
                    "{what} ({}): the upstream got no `Authorization: Bearer <secret>`: the \
                     proxy did not inject the secret\n--- request head ---\n{}",
                    side.label(),
                    request.replace(&targets.secret, "<secret>")
                ));
            }
        }
    }
    say(format!(
        "egress: curl host: {}; guest: {}",
        report.config.curl_host, report.config.curl_guest
    ));

    for kind in Kind::ALL {
        let mut samples: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        let mut connects = [0u64; 2];
        let mut error = None;
        'calls: for call in 0..kind.calls(s) {
            for side in order(call) {
                let k = if side == Side::Host { 0 } else { 1 };
                let what = format!("{} call {}/{}", kind.name(), call + 1, kind.calls(s));
                let bytes = s.throughput_mib << 20;
                let args = curl_args(kind, side, &targets, "/latency", s.latency_requests, bytes);
                let result = runner.run(side, &what, args).and_then(|ran| {
                    let parsed = match kind {
                        Kind::Throughput => parse_download(&ran.stdout, bytes).map(|d| {
                            let v = d.bytes_per_s / (1u64 << 20) as f64;
                            say(format!(
                                "[egress {what}] {:>5}: {v:.2} MiB/s ({:.2} s)",
                                side.label(),
                                d.secs
                            ));
                            (vec![v], 0)
                        }),
                        _ => parse_latency(&ran.stdout, s.latency_requests).map(|t| {
                            let ms: Vec<f64> = t.iter().map(|t| t.secs * 1000.0).collect();
                            let mut sorted = ms.clone();
                            sorted.sort_by(|a, b| a.total_cmp(b));
                            say(format!(
                                "[egress {what}] {:>5}: median {:.2} ms, min {:.2}, max {:.2}",
                                side.label(),
                                crate::stats::median(&sorted),
                                sorted[0],
                                sorted[sorted.len() - 1]
                            ));
                            (ms, t.iter().map(|t| t.connects).sum())
                        }),
                    };
                    parsed.map_err(|e| {
                        format!(
                            "{what} ({}): {e}\n--- stdout (tail) ---\n{}\n--- stderr (tail) ---\n{}",
                            side.label(),
                            tail(&ran.stdout, 1500),
                            tail(&ran.stderr, 2000)
                        )
                    })
                });
                match result {
                    Ok((v, c)) => {
                        samples[k].extend(v);
                        connects[k] += c;
                    }
                    Err(e) => {
                        say(format!("error: {e}"));
                        error = Some(e);
                        break 'calls;
                    }
                }
            }
        }
        report
            .figures
            .push(EgressFigure::new(kind, s, samples, connects, error));
    }
    let connects: Vec<String> = report
        .figures
        .iter()
        .filter_map(|f| {
            let (h, g) = (f.host_connects?, f.guest_connects?);
            Some(format!("{}: host {h}, guest {g}", f.name))
        })
        .collect();
    report.notes.push(format!(
        "New connections curl opened (num_connects, summed over the {} requests per side and \
         figure): {}. The upstreams close every connection after one request, so each host \
         request is a new TCP connection (and TLS handshake); a guest count below the number of \
         requests means curl kept its connection to the proxy between the URLs of a call (the \
         proxy still connects to the upstream for each request), and then the first URL of \
         each guest call carries that connection's set-up (for HTTPS: the guest's TLS \
         handshake with the proxy), the others do not.",
        s.latency_requests * s.latency_rounds,
        connects.join("; ")
    ));
    vmctl.rm(&ws).map_err(|e| format!("vmctl rm: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_and_guest_alternate_which_goes_first() {
        assert_eq!(order(0), [Side::Host, Side::Guest]);
        assert_eq!(order(1), [Side::Guest, Side::Host]);
        assert_eq!(order(2), order(0));
    }

    #[test]
    fn latency_lines_are_parsed() {
        let t = parse_latency("200 0.001234 1\n200 0,5 0\n", 2).unwrap();
        assert_eq!(
            t,
            vec![
                Transfer {
                    code: 200,
                    secs: 0.001234,
                    connects: 1
                },
                Transfer {
                    code: 200,
                    secs: 0.5,
                    connects: 0
                }
            ]
        );
        // Blank lines and \r are ignored.
        assert_eq!(parse_latency("\n200 1.5 1\r\n\n", 1).unwrap()[0].secs, 1.5);
        let e = parse_latency("200 0.1 1\n", 2).unwrap_err();
        assert!(e.contains("1 line(s), expected 2"), "{e}");
        let e = parse_latency("200 0.1 1\n403 0.01 0\n", 2).unwrap_err();
        assert!(e.contains("request 2: HTTP status 403"), "{e}");
        // A failed transfer prints 000.
        assert!(parse_latency("000 0.000000 0\n", 1).is_err());
        assert!(parse_latency("200 abc 1\n", 1).is_err());
        assert!(parse_latency("200 -1 1\n", 1).is_err());
        assert!(parse_latency("200 NaN 1\n", 1).is_err());
        assert!(parse_latency("200 0.1\n", 1).is_err());
        assert!(parse_latency("200 0.1 x\n", 1).is_err());
        assert!(parse_latency("", 1).is_err());
    }

    #[test]
    fn downloads_are_parsed_and_checked() {
        let d = parse_download("200 16777216 8388608 2.000000\n", 16 << 20).unwrap();
        assert_eq!(d.bytes_per_s, 8_388_608.0);
        assert_eq!(d.secs, 2.0);
        let e = parse_download("200 100 50 2.0\n", 16 << 20).unwrap_err();
        assert!(e.contains("downloaded 100 bytes, expected 16777216"), "{e}");
        assert!(parse_download("502 0 0 0.1\n", 0)
            .unwrap_err()
            .contains("502"));
        assert!(parse_download("200 0 0 0.1\n", 0).is_err());
        assert!(parse_download("200 1 1 1\n200 1 1 1\n", 1).is_err());
        assert!(parse_download("", 1).is_err());
        // Newer curl versions print decimals.
        assert_eq!(
            parse_download("200 10 12.5 0.8\n", 10).unwrap().bytes_per_s,
            12.5
        );
    }

    fn targets() -> Targets {
        Targets {
            http_port: 8080,
            https_port: 8443,
            ca_file: "/tmp/ca.pem".into(),
            secret: "s3cret".into(),
        }
    }

    #[test]
    fn curl_commands() {
        let t = targets();
        let a = curl_args(Kind::LatencyHttp, Side::Guest, &t, "/latency", 2, 0).join(" ");
        assert_eq!(
            a,
            r"-sS -w %{http_code} %{time_total} %{num_connects}\n -o /dev/null http://bench.test/latency -o /dev/null http://bench.test/latency"
        );
        let a = curl_args(Kind::LatencyHttp, Side::Host, &t, "/latency", 1, 0).join(" ");
        assert!(
            a.starts_with("-sS --noproxy * --connect-to bench.test:80:127.0.0.1:8080 -w"),
            "{a}"
        );
        let a = curl_args(Kind::LatencyHttps, Side::Host, &t, "/x", 1, 0).join(" ");
        assert!(
            a.contains("--connect-to bench.test:443:127.0.0.1:8443 --cacert /tmp/ca.pem -H Authorization: Bearer s3cret"),
            "{a}"
        );
        assert!(a.ends_with("-o /dev/null https://bench.test/x"), "{a}");
        let a = curl_args(Kind::LatencyHttps, Side::Guest, &t, "/x", 1, 0).join(" ");
        assert!(!a.contains("--cacert") && !a.contains("s3cret") && !a.contains("--connect-to"));
        let a = curl_args(Kind::Throughput, Side::Guest, &t, "", 0, 1 << 24).join(" ");
        assert_eq!(
            a,
            r"-sS -w %{http_code} %{size_download} %{speed_download} %{time_total}\n -o /dev/null http://bench.test/bytes/16777216"
        );
    }

    #[test]
    fn sizes_and_figures() {
        let q = sizes(true);
        assert_eq!(
            (q.latency_requests, q.throughput_mib, q.throughput_runs),
            (10, 16, 2)
        );
        let f = sizes(false);
        assert_eq!(
            (f.latency_requests, f.throughput_mib, f.throughput_runs),
            (50, 64, 3)
        );
        assert_eq!(f.calls(), 6 + 2 * (4 + 3));

        let l = EgressFigure::new(
            Kind::LatencyHttp,
            &q,
            [vec![1.0, 2.0, 3.0], vec![5.0, 6.0, 7.0]],
            [3, 1],
            None,
        );
        assert_eq!(l.added_ms, Some(4.0));
        assert_eq!(l.guest_slowdown, Some(3.0));
        assert_eq!((l.host_connects, l.guest_connects), (Some(3), Some(1)));
        assert_eq!((l.requests_per_call, l.size_mib), (Some(10), None));
        let t = EgressFigure::new(
            Kind::Throughput,
            &q,
            [vec![400.0], vec![100.0]],
            [0, 0],
            None,
        );
        assert_eq!((t.guest_slowdown, t.added_ms), (Some(4.0), None));
        assert_eq!(t.size_mib, Some(16));
        let e = EgressFigure::new(Kind::Throughput, &q, [vec![1.0], vec![]], [0, 0], None);
        assert!(e.error.as_deref().unwrap().contains("no valid samples"));
        assert_eq!(e.guest_slowdown, None);

        let r = EgressReport {
            note: "Nested: one level deeper.".into(),
            host: "the nested host".into(),
            nested: true,
            config: EgressConfig {
                sizes: q,
                host_name: HOST_NAME.into(),
                upstream_http: String::new(),
                upstream_https: String::new(),
                timeout_s: 60,
                command_timeout_s: 300,
                workspace: String::new(),
                vm_cpus: 2,
                vm_memory_mib: 1024,
                vm_nested: false,
                curl_host: String::new(),
                curl_guest: String::new(),
            },
            commands: vec![],
            environment: vec![],
            figures: vec![l, t, e],
            notes: vec!["A note.".into()],
            error: None,
        };
        let md = r.markdown();
        assert!(
            md.contains("| egress_latency_http_ms | ms | 2.00 | 6.00 | 3.00 | 7.00 | 1.00–3.00 | 5.00–7.00 | 3 | 4.00 ms | 3.00x |"),
            "{md}"
        );
        assert!(
            md.contains("| egress_throughput_http_mib_s | MiB/s | 400 | 100 | 400 | 100 | 400–400 | 100–100 | 1 | – | 4.00x |"),
            "{md}"
        );
        assert!(md.contains("| 1/0 | error | error |"), "{md}");
        assert!(md.contains("one level deeper") && md.contains("A note."));
        assert_eq!(r.errors().len(), 1);
        let json = serde_json::to_string(&r).unwrap();
        let back: EgressReport = serde_json::from_str(&json).unwrap();
        assert_eq!(back.figures[0].added_ms, Some(4.0));
    }

    /// A fake `vmctl` whose "guest" is this machine, its "proxy" what curl is told:
    /// `exec` runs curl with the upstreams' addresses from `up`, the test CA and the
    /// stored secret's header (not with `dir/no-inject`); with `dir/fail-bytes`, the
    /// download fails in the "guest".
    fn fake_bench(dir: &Path) -> EgressBench {
        let script = dir.join("vmctl");
        fs::write(
            &script,
            format!(
                r#"#!/bin/bash
set -e
echo "$1" >> {dir}/calls.log
s="$XDG_STATE_HOME"
case "$1" in
  policy) [ "$2 $3 $4" = "allow bench.test --global" ];;
  secret) [ "$2 $3 $4 $5" = "set bench --host bench.test" ]; mkdir -p "$s"; cat > "$s/secret";;
  up) shift; args=()
    while [ $# -gt 1 ]; do
      case "$1" in
        --egress-test-ca) args+=(--cacert "$2"); shift 2;;
        --egress-test-resolve) args+=(--connect-to "${{2%%=*}}:${{2#*=}}"); shift 2;;
        *) exit 9;;
      esac
    done
    d="$s/vmctl/vms/x"; mkdir -p "$d"; printf '%s\n' "${{args[@]}}" > "$s/curl-args"
    printf '{{"workspace":"%s","cpus":2,"memory_mib":1024}}' "$1" > "$d/vm.json";;
  exec) shift 4
    [ "$2" = --version ] && exec "$@"
    case "$*" in *bytes*) [ -e {dir}/fail-bytes ] && {{ echo 'proxy broke' >&2; exit 7; }};; esac
    mapfile -t args < "$s/curl-args"
    [ -e {dir}/no-inject ] || args+=(-H "Authorization: Bearer $(cat "$s/secret")")
    exec "$1" --noproxy '*' "${{args[@]}}" "${{@:2}}";;
  rm) rm -rf "$s/vmctl/vms/x";;
esac
"#,
                dir = dir.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
        EgressBench {
            artifacts: GuestArtifacts {
                vmctl: script,
                kernel: "/k".into(),
                agent_initramfs: "/a".into(),
                rootfs: "/r".into(),
            },
            sizes: EgressSizes {
                latency_requests: 3,
                latency_rounds: 2,
                throughput_mib: 1,
                throughput_runs: 2,
            },
            timeout: Duration::from_secs(30),
            command_timeout: Duration::from_secs(60),
            nested: false,
            curl: "curl".into(),
        }
    }

    /// The whole section against the real upstreams and this machine's curl.
    #[test]
    fn measures_both_sides_and_removes_the_vm() {
        if Command::new("curl").arg("--version").output().is_err() {
            vm_tests::not_run(
                "egress::tests::measures_both_sides_and_removes_the_vm",
                "it needs curl (scripts/setup.sh installs it), and there is none here",
            );
            return;
        }
        let dir = std::env::temp_dir().join(format!("vm-bench-egress-{}", std::process::id()));
        let _tmp = TempDir(dir.clone());
        fs::create_dir_all(&dir).unwrap();
        let b = fake_bench(&dir);
        let r = measure(&b);
        assert_eq!(r.error, None);
        assert!(r.errors().is_empty(), "{:?}", r.errors());
        assert_eq!(r.figures.len(), 3);
        for (f, n) in r.figures.iter().zip([6, 6, 2]) {
            assert_eq!(f.host.as_ref().unwrap().samples.len(), n, "{}", f.name);
            assert_eq!(f.guest.as_ref().unwrap().samples.len(), n, "{}", f.name);
            assert!(f.guest_slowdown.is_some(), "{}", f.name);
        }
        // The upstream closes each connection: curl opens one per request.
        assert_eq!(r.figures[1].host_connects, Some(6));
        assert!(
            r.config.curl_host.starts_with("curl "),
            "{}",
            r.config.curl_host
        );
        assert_eq!(r.config.vm_cpus, 2);
        let json = serde_json::to_string(&r).unwrap();
        assert!(
            !json.contains("bench-secret-"),
            "the report holds the secret"
        );
        assert!(json.contains("Authorization: Bearer SECRET"), "{json}");
        let calls = fs::read_to_string(dir.join("calls.log")).unwrap();
        let calls: Vec<&str> = calls.lines().collect();
        assert_eq!(calls[..3], ["policy", "secret", "up"]);
        // The VM is removed after the last exec (cleanup may run more commands).
        let last = |c: &str, calls: &[&str]| calls.iter().rposition(|x| *x == c);
        assert!(last("rm", &calls) > last("exec", &calls), "{calls:?}");
        // 1 version + 2 probes + 2 x 2 latency calls + 2 downloads, in the guest.
        assert_eq!(calls.iter().filter(|c| **c == "exec").count(), 9);
        assert!(r.markdown().contains("| egress_latency_https_ms | ms |"));

        // A download that fails is that figure's error; the rest is measured.
        fs::write(dir.join("fail-bytes"), "").unwrap();
        let r = measure(&b);
        assert_eq!(r.error, None);
        let errors = r.errors();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].0, "egress_throughput_http_mib_s");
        assert!(errors[0].1.contains("proxy broke"), "{}", errors[0].1);
        assert!(r.figures[0].guest_slowdown.is_some());
        fs::remove_file(dir.join("fail-bytes")).unwrap();

        // No injected secret: the section fails, and the VM is removed.
        fs::write(dir.join("calls.log"), "").unwrap();
        fs::write(dir.join("no-inject"), "").unwrap();
        let r = measure(&b);
        let e = r.error.as_deref().unwrap();
        assert!(e.contains("did not inject the secret"), "{e}");
        assert!(r.figures.is_empty());
        let calls = fs::read_to_string(dir.join("calls.log")).unwrap();
        let calls: Vec<&str> = calls.lines().collect();
        assert!(last("rm", &calls) > last("up", &calls), "{calls:?}");
    }
}
