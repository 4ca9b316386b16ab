//! The guest agent: `/init` of the VM's initramfs (PID 1), or a plain server for
//! tests and debugging (`guest-agent --listen unix:/tmp/agent.sock`).

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use guest_agent::cgroups::{self, ExecCgroups};
use guest_agent::host_edits::HostEditTarget;
use guest_agent::init;
use guest_agent::server::{self, ListenAddr, ServerConfig};

const USAGE: &str =
    "usage: guest-agent [--listen unix:PATH|vsock:PORT] [--user NAME:UID:GID:HOME] [--log LEVEL]
As PID 1 it boots the VM (see the vmctl.* kernel parameters) and listens on vsock;
with vmctl.run=PATH it runs PATH once instead, then powers the VM off.";

struct Args {
    listen: Option<ListenAddr>,
    user: Option<server::HostUser>,
    log: tracing::Level,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        listen: None,
        user: None,
        log: tracing::Level::INFO,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match a.as_str() {
            "--listen" => args.listen = Some(value("--listen")?.parse()?),
            "--user" => {
                args.user = Some(init::parse_user(&value("--user")?).map_err(|e| e.to_string())?)
            }
            "--log" => {
                args.log = value("--log")?
                    .parse()
                    .map_err(|_| "bad --log level".to_string())?
            }
            "-h" | "--help" => return Err(USAGE.to_string()),
            // The kernel passes unknown command-line words to init as arguments.
            _ if init::is_pid1() => {}
            other => return Err(format!("unknown argument '{other}'\n{USAGE}")),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    let pid1 = init::is_pid1();
    let mut args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let mut config = ServerConfig {
        default_user: args.user.take(),
        reap_all: pid1,
        follow_host_clock: pid1,
        ..Default::default()
    };
    let mut writable_shares = Vec::new();
    let mut share_views = Vec::new();
    let listen = if pid1 {
        let boot = init::boot();
        if let Some(program) = &boot.run {
            init::run_once_then_power_off(program);
        }
        config.default_user = boot.user.clone();
        config.drop_caches_after_idle = boot.drop_caches_idle;
        let writable = boot.shares.iter().filter(|share| !share.read_only);
        writable_shares = writable.map(|share| share.path.clone()).collect();
        share_views = init::read_only_views(&writable_shares);
        args.listen.take().unwrap_or(ListenAddr::Vsock(boot.port))
    } else {
        args.listen
            .take()
            .unwrap_or(ListenAddr::Vsock(guest_agent::protocol::DEFAULT_PORT))
    };
    tracing_subscriber::fmt()
        .with_max_level(args.log)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(false)
        .init();
    // After the logger: a guest that cannot watch its own writes is said.
    config.host_edits =
        Arc::new(HostEditTarget::for_shares(writable_shares).with_views(share_views));
    if pid1 {
        match ExecCgroups::open(Path::new(cgroups::GUEST_DIR)) {
            Ok(cgroups) => config.exec_cgroups = Some(cgroups),
            Err(e) => tracing::warn!(
                "{e}: when a client goes away, its command's processes outside the \
                 command's process group live on"
            ),
        }
    }

    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return fatal(pid1, &format!("cannot start the runtime: {e}")),
    };
    let result = runtime.block_on(async {
        let listener = server::Listener::bind(&listen)?;
        tracing::info!(
            ?listen,
            version = guest_agent::protocol::AGENT_VERSION,
            "agent listening"
        );
        init::signal_ready();
        server::serve(listener, config).await
    });
    match result {
        Ok(()) if pid1 => {
            init::console("shutting down");
            init::power_off()
        }
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fatal(pid1, &e.to_string()),
    }
}

fn fatal(pid1: bool, msg: &str) -> ExitCode {
    init::console(&format!("fatal: {msg}"));
    if pid1 {
        init::power_off();
    }
    ExitCode::FAILURE
}
