//! `vmctl`: the host CLI of the micro-VM runtime.

mod agent;
mod artifacts;
mod bench;
mod boot;
mod cli;
mod daemon;
mod egress_commands;
mod exec;
mod git_guard;
mod git_identity;
mod guest_account;
mod guest_clock;
mod guest_writable;
mod host_edits;
mod host_kvm;
mod log_keeper;
mod logs;
mod lost_vm;
mod nested;
mod network;
mod own_socket;
mod paseo;
mod ports;
mod procfs;
mod share_root;
mod shares;
mod start_notice;
mod state;
mod stdin_reader;
mod supervisor;
mod terminal;
mod user_config;
mod virtiofsd;
mod vm;
mod vmm_process;
mod workspace;
mod worktree;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    user_config::make_config_path_absolute();
    init_logging();
    // The nested host's kernel starts us as its init with the job in the environment
    // (kernel arguments after `--` would hide QEMU's own device arguments).
    if let Some(job) = nested::init::job_from_environment() {
        return exit_with(
            nested::init::run(&job).map_err(|e| e.to_string()),
            ExitCode::FAILURE,
        );
    }
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return usage_error(&error, std::env::args_os().nth(1).as_deref()),
    };
    let own_failure = if cli.command.passes_exit_code_on() {
        ExitCode::from(cli::OWN_FAILURE)
    } else {
        ExitCode::FAILURE
    };
    let result = match cli.command {
        cli::Command::Boot(args) => boot::run(args).map_err(|e| e.to_string()),
        cli::Command::Up(args) => {
            let egress = state::EgressTestOptions {
                extra_ca: args.egress_test_ca.clone(),
                resolve: args.egress_test_resolve.clone(),
            };
            let options = vm::StartOptions {
                recipe: args.recipe.as_deref(),
                mounts: &args.setup.mounts,
                relay_ports: &args.setup.relay_ports,
                egress: Some(&egress).filter(|e| **e != state::EgressTestOptions::default()),
                quiet: false,
            };
            workspace::resolve_to_start(args.workspace.dir(), args.setup.isolation.isolation)
                .map_err(|e| e.to_string())
                .and_then(|dir| up_pinned(&dir, &options))
        }
        cli::Command::Ps(args) => {
            let rows = vm::list();
            if args.json {
                // JSON escapes what a directory's name (the guest's to choose, in a
                // share) may hold.
                serde_json::to_string_pretty(&rows)
                    .map_err(|e| format!("cannot write the VM list as JSON: {e}"))
                    .map(|json| {
                        terminal::print_out(format_args!("{json}\n"));
                        0
                    })
            } else {
                // Paths and the daemon's lease names, which a directory's name may
                // fill with escape sequences.
                vm::table(&rows).iter().for_each(|line| {
                    terminal::print_out(format_args!("{}\n", terminal::printable(line)))
                });
                Ok(0)
            }
        }
        cli::Command::Stop(args) => {
            let dir = workspace::of_vm(args.dir());
            unpin(&dir);
            vm::stop(&dir).map_err(|e| e.to_string()).map(|stopped| {
                if !stopped {
                    vmm::to_stderr!("vmctl: no VM is running for {}", dir.display());
                }
                0
            })
        }
        cli::Command::Rm(args) => {
            let dir = workspace::of_vm(args.workspace.dir());
            if removal_confirmed(&dir, args.force) {
                unpin(&dir);
                vm::remove(&dir).map_err(|e| e.to_string()).map(|removed| {
                    if removed {
                        vmm::to_stderr!("vmctl: removed the VM of {} and its state", dir.display());
                    } else {
                        vmm::to_stderr!("vmctl: {} has no VM", dir.display());
                    }
                    0
                })
            } else {
                Err("nothing removed".to_string())
            }
        }
        cli::Command::Prune(args) => Ok(vm::prune(&state::VmDir::all(), args.dry_run)),
        cli::Command::Agent(args) => {
            let (isolation, skip_permissions) = (args.isolation.isolation, args.skip_permissions);
            args.cli().and_then(|(cli, args)| {
                let workspace =
                    workspace::resolve_to_start(None, isolation).map_err(|e| e.to_string())?;
                agent::run(agent::AgentOptions {
                    workspace,
                    cli,
                    skip_permissions,
                    args,
                })
                .map_err(|e| e.to_string())
            })
        }
        cli::Command::Daemon(args) if args.stop => daemon::client::shutdown()
            .map(|stopped| {
                if stopped {
                    vmm::to_stderr!("vmctl: the daemon stopped, and every VM with it");
                } else {
                    vmm::to_stderr!("vmctl: no daemon is running");
                }
                0
            })
            .map_err(|e| e.to_string()),
        cli::Command::Daemon(_) => daemon::server::run().map_err(|e| e.to_string()),
        cli::Command::Bench(args) => bench::run(args.quick, args.args).map_err(|e| e.to_string()),
        cli::Command::Paseo(command) => paseo::run(command).map_err(|e| e.to_string()),
        cli::Command::Exec(args) => run_exec(args),
        cli::Command::Shell(args) => run_shell(args),
        cli::Command::Run(args) => run_throwaway(args),
        cli::Command::Supervise { dir } => supervisor::run(&dir),
        cli::Command::Logs(args) => logs::show(
            &workspace::of_vm(args.workspace.dir()),
            logs::LogsOptions {
                supervisor: args.supervisor,
                previous: args.previous,
                lines: args.lines,
                follow: args.follow,
            },
        )
        .map(|()| 0)
        .map_err(|e| e.to_string()),
        cli::Command::Ports(args) => ports::list(&workspace::of_vm(args.dir()))
            .map(|_| 0)
            .map_err(|e| e.to_string()),
        cli::Command::Publish(args) => {
            cli::dir_and_port(&args.target, args.workspace).and_then(|(dir, port)| {
                ports::publish(&workspace::of_vm(dir), port, args.host_port, args.address)
                    .map(|host| {
                        terminal::print_out(format_args!("{host}\n"));
                        0
                    })
                    .map_err(|e| e.to_string())
            })
        }
        cli::Command::Unpublish(args) => {
            cli::dir_and_port(&args.target, args.workspace).and_then(|(dir, port)| {
                ports::unpublish(&workspace::of_vm(dir), port)
                    .map(|host| {
                        vmm::to_stderr!("vmctl: {host} no longer forwards to guest port {port}");
                        0
                    })
                    .map_err(|e| e.to_string())
            })
        }
        cli::Command::Secret(command) => {
            egress_commands::secret(command).map_err(|e| e.to_string())
        }
        cli::Command::Policy(command) => {
            egress_commands::policy(command).map_err(|e| e.to_string())
        }
        cli::Command::Image(cli::ImageCommand::Build { recipe }) => {
            artifacts::build_image(recipe.as_deref(), artifacts::Unbuilt::Fails)
                .map(|path| {
                    terminal::print_out(format_args!("{}\n", path.display()));
                    0
                })
                .map_err(|e| e.to_string())
        }
        cli::Command::NestedExec(args) => nested_exec(args),
    };
    if let Ok(code) = result {
        exec::end_by_the_signal_that_ended_it(code);
    }
    exit_with(result, own_failure)
}

/// Prints clap's refusal (or the help asked for), and exits as clap would, but for a
/// command that passes its command's exit code on: there wrong arguments are vmctl's
/// failure, [`cli::OWN_FAILURE`], not a 2 the command might have exited with.
fn usage_error(error: &clap::Error, command: Option<&std::ffi::OsStr>) -> ExitCode {
    // A reader gone or a full disk: the exit code still tells.
    let _ = error.print();
    ExitCode::from(usage_exit_code(error, command))
}

fn usage_exit_code(error: &clap::Error, command: Option<&std::ffi::OsStr>) -> u8 {
    let code = u8::try_from(error.exit_code()).unwrap_or(1);
    // `use_stderr` is false for the help and the version, which are no failure.
    if error.use_stderr() && command.is_some_and(cli::named_command_passes_exit_code_on) {
        cli::OWN_FAILURE
    } else {
        code
    }
}

fn run_exec(args: cli::ExecArgs) -> Result<u8, String> {
    let options = vm::StartOptions {
        mounts: &args.setup.mounts,
        relay_ports: &args.setup.relay_ports,
        quiet: true,
        ..vm::StartOptions::default()
    };
    let dir = workspace::resolve_to_start(args.workspace.clone(), args.setup.isolation.isolation)
        .map_err(|e| e.to_string())?;
    let _lease = lease(&dir, "exec");
    let vm = vm::up(&dir, &options).map_err(|e| e.to_string())?;
    exec_in(&vm, args)
}

/// A daemon lease on the VM of `dir` for this session; without a daemon the VM just
/// does not stop by itself, which is worth a warning, not a failure.
fn lease(dir: &std::path::Path, purpose: &str) -> Option<daemon::client::Lease> {
    let (_, vm) = state::VmDir::for_workspace(dir).ok()?;
    lease_vm(&vm, purpose)
}

/// A lease on `vm`, or a warning that without one it will not stop by itself.
fn lease_vm(vm: &state::VmDir, purpose: &str) -> Option<daemon::client::Lease> {
    daemon::client::lease(vm, purpose)
        .map_err(|e| vmm::to_stderr!("vmctl: warning: {e}; the VM will not stop by itself"))
        .ok()
}

/// `vmctl up`: starts the VM of `dir` pinned, so the daemon keeps it until `vmctl stop`.
fn up_pinned(dir: &std::path::Path, options: &vm::StartOptions) -> Result<u8, String> {
    let (_, vm) = state::VmDir::for_workspace(dir).map_err(|e| e.to_string())?;
    // Pinned before it starts, so the daemon never takes it for idle.
    if let Err(e) = daemon::client::pin(&vm) {
        vmm::to_stderr!("vmctl: warning: {e}");
    }
    vm::up(dir, options)
        .map(|_| {
            vmm::to_stderr!(
                "vmctl: it stays up until `vmctl stop` (a VM that `exec`, `shell` or \
                 `agent` started alone stops once idle)"
            );
            0
        })
        .map_err(|e| {
            // One that did not start is not pinned for whoever starts it next; but
            // another `vmctl up` starting it meanwhile pinned it too (a pin is one
            // flag), and its VM must stay up. (A start of another kind keeps the pin
            // as well: a VM kept up by mistake beats one stopped by mistake.)
            if vm.running_pid().is_none() && !vm::lifecycle_lock_held(&vm) {
                unpin(dir);
            }
            e.to_string()
        })
}

/// Whether `vmctl rm` (`-f`: `force`) may go on: see [`removal_decision`].
fn removal_confirmed(dir: &std::path::Path, force: bool) -> bool {
    use std::io::IsTerminal;
    // `-f` does not look: it asks nothing whatever there is.
    let sessions = if force {
        Vec::new()
    } else {
        state::VmDir::lookup(dir)
            .map(|(_, vm)| agent::session_dirs(&vm))
            .unwrap_or_default()
    };
    let terminal = std::io::stdin().is_terminal() && std::io::stderr().is_terminal();
    removal_decision(
        dir,
        &sessions,
        force,
        terminal,
        &mut std::io::stdin().lock(),
        &mut std::io::stderr(),
    )
}

/// Whether removing the VM of `dir`, which keeps agent `sessions`, may go on: yes,
/// unless there are sessions (which `--resume` needs) and the person at the terminal
/// (`terminal`: stdin and stderr are terminals), asked on `prompt`, does not answer yes on
/// `answer`. `force` (`-f`) and a caller with no terminal (a script) are not asked.
fn removal_decision(
    dir: &std::path::Path,
    sessions: &[std::path::PathBuf],
    force: bool,
    terminal: bool,
    answer: &mut impl std::io::BufRead,
    prompt: &mut impl std::io::Write,
) -> bool {
    if force || sessions.is_empty() || !terminal {
        return true;
    }
    let listed: Vec<String> = sessions.iter().map(|d| d.display().to_string()).collect();
    let question = format!(
        "vmctl: the VM of {} keeps agent sessions (in {}), which `--resume` needs; \
         remove them with it? [y/N]",
        dir.display(),
        listed.join(", ")
    );
    let _ = writeln!(prompt, "{}", vmm::process::printable(&question));
    let mut said = String::new();
    if answer.read_line(&mut said).is_err() {
        return false;
    }
    matches!(said.trim(), "y" | "Y" | "yes" | "Yes")
}

/// Lets the daemon stop the VM of `dir` (`vmctl stop`/`rm` stop it anyway).
fn unpin(dir: &std::path::Path) {
    if let Ok((_, vm)) = state::VmDir::lookup(dir) {
        if let Err(e) = daemon::client::unpin(&vm) {
            vmm::to_stderr!("vmctl: warning: {e}");
        }
    }
}

fn run_throwaway(args: cli::ExecArgs) -> Result<u8, String> {
    let dir = workspace::resolve_to_start(args.workspace.clone(), args.setup.isolation.isolation)
        .map_err(|e| e.to_string())?;
    vm::check_workspace_ways(&dir).map_err(|e| e.to_string())?;
    let (workspace, vm) = state::VmDir::throwaway(&dir).map_err(|e| e.to_string())?;
    // Taken before the VM starts and held until it is gone: should this vmctl die
    // first, even while the VM boots, the daemon stops the VM once idle instead of
    // leaving it running for good.
    let _lease = lease_vm(&vm, "vmctl run");
    let vm = vm::up_throwaway(&workspace, vm, &args.setup).map_err(|e| e.to_string())?;
    let outcome = exec_in(&vm, args);
    match vm::remove_throwaway(&vm) {
        vm::Teardown::Done(Ok(())) => outcome,
        vm::Teardown::Done(Err(e)) => {
            vmm::to_stderr!("vmctl: warning: cannot clean up the throwaway VM: {e}");
            outcome
        }
        vm::Teardown::Interrupted(signal) => {
            if let Err(e) = &outcome {
                vmm::to_stderr!("vmctl: error: {e}");
            }
            vmm::to_stderr!(
                "vmctl: interrupted while removing the throwaway VM: the daemon stops it \
                 once idle, and `vmctl prune` removes what is left ({})",
                vm.path.display()
            );
            Ok(exec::exit_code(None, Some(signal)))
        }
    }
}

/// `vmctl nested-exec`: its command goes to the nested host in a JSON job, which
/// holds text only.
fn nested_exec(args: cli::NestedExecArgs) -> Result<u8, String> {
    let argv = args
        .command
        .into_iter()
        .map(|arg| {
            arg.into_string().map_err(|arg| {
                format!(
                    "the argument {arg:?} is not UTF-8, which the nested host's job (JSON) \
                     cannot carry"
                )
            })
        })
        .collect::<Result<Vec<String>, String>>()?;
    nested::launcher::run_command(argv, args.cpus, args.memory, &args.writable)
        .map_err(|e| e.to_string())
}

fn exec_in(vm: &state::VmDir, args: cli::ExecArgs) -> Result<u8, String> {
    let here = workspace::current_dir();
    let cwd = exec::guest_cwd(vm, &here);
    let user = exec::parse_user(args.user.as_deref());
    let options = exec::ExecOptions {
        argv: args.command,
        // Yours last: `--env` can override what vmctl sets.
        env: git_identity::guest_env(vm, &here)
            .into_iter()
            .map(|(name, value)| (name, value.into()))
            .chain(agent::config_homes_env(vm, &user))
            .chain(args.env)
            .collect(),
        cwd: Some(cwd),
        user,
        tty: args.tty,
        stdin: !args.no_stdin,
    };
    git_guard::watch(vm, || exec::run(&vm.vsock_socket(), options))
        .map_err(|e| lost_vm::explain(vm, &e))
}

fn run_shell(args: cli::ShellArgs) -> Result<u8, String> {
    // A named workspace starts the shell at its root, else where we are.
    let named = args.workspace.dir();
    let start_in = match &named {
        Some(dir) => dir.clone(),
        None => workspace::current_dir(),
    };
    let dir = workspace::resolve_to_start(named, args.setup.isolation.isolation)
        .map_err(|e| e.to_string())?;
    let options = vm::StartOptions {
        mounts: &args.setup.mounts,
        relay_ports: &args.setup.relay_ports,
        quiet: true,
        ..vm::StartOptions::default()
    };
    let _lease = lease(&dir, "shell");
    let vm = vm::up(&dir, &options).map_err(|e| e.to_string())?;
    let options = exec::ExecOptions {
        argv: vec!["/bin/bash".into(), "-l".into()],
        env: git_identity::guest_env(&vm, &start_in)
            .into_iter()
            .map(|(name, value)| (name, value.into()))
            .chain(agent::config_homes_env(
                &vm,
                &guest_agent::protocol::User::Default,
            ))
            .collect(),
        cwd: Some(exec::guest_cwd(&vm, &start_in)),
        user: exec::parse_user(None),
        // As ssh: a terminal gets a PTY; commands piped in get a plain shell
        // reading them, whose output carries no echo or escape sequences.
        tty: std::io::stdin().is_terminal(),
        stdin: true,
    };
    git_guard::watch(&vm, || exec::run(&vm.vsock_socket(), options))
        .map_err(|e| lost_vm::explain(&vm, &e))
}

fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VMCTL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colours only for a person: stderr is often a VM's log file.
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        // Its report of a failed write is an eprintln!, which would abort vmctl.
        .log_internal_errors(false)
        .init();
}

/// The command's outcome: its exit code, or its error said and `failure`.
fn exit_with(result: Result<u8, String>, failure: ExitCode) -> ExitCode {
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            // The error may be that stderr cannot be written; the exit code still says
            // it failed.
            vmm::to_stderr!("vmctl: error: {e}");
            failure
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// README: `vmctl rm` "asks first on a terminal when there are sessions; -f does
    /// not". Each case: what was answered, whether it may remove, what was asked.
    #[test]
    fn rm_asks_before_removing_agent_sessions_on_a_terminal_alone() {
        let dir = std::path::Path::new("/src/app");
        let sessions = [std::path::PathBuf::from(
            "/state/vms/app-1/agent-home/claude/projects",
        )];
        let decide = |sessions: &[std::path::PathBuf], force: bool, terminal: bool, typed: &str| {
            let mut answer = typed.as_bytes();
            let mut prompt = Vec::new();
            let removes =
                removal_decision(dir, sessions, force, terminal, &mut answer, &mut prompt);
            (
                removes,
                answer.len() < typed.len(),
                String::from_utf8(prompt).unwrap(),
            )
        };

        // On a terminal, with sessions: asked; only a yes removes.
        for (typed, removes) in [
            ("n\n", false),
            ("\n", false),
            ("", false),
            ("yes please\n", false),
            ("y\n", true),
            ("yes\n", true),
            (" Y \n", true),
        ] {
            let (removed, read, asked) = decide(&sessions, false, true, typed);
            assert_eq!(removed, removes, "{typed:?}");
            assert!(read || typed.is_empty(), "{typed:?} was not read");
            assert_eq!(
                asked,
                "vmctl: the VM of /src/app keeps agent sessions (in \
                 /state/vms/app-1/agent-home/claude/projects), which `--resume` needs; remove \
                 them with it? [y/N]\n"
            );
        }
        // `-f`, no terminal (a script: the README's promise is about a terminal), or no
        // sessions: removed without a question, and nothing read.
        for (sessions, force, terminal) in [
            (&sessions[..], true, true),
            (&sessions[..], false, false),
            (&[][..], false, true),
        ] {
            assert_eq!(
                decide(sessions, force, terminal, "n\n"),
                (true, false, String::new()),
                "force {force}, terminal {terminal}, {} session(s)",
                sessions.len()
            );
        }
    }

    #[test]
    fn wrong_arguments_to_a_command_that_passes_its_code_on_exit_125() {
        let exit_code = |argv: &[&str]| {
            let error = cli::Cli::try_parse_from([&["vmctl"], argv].concat()).unwrap_err();
            usage_exit_code(&error, argv.first().map(std::ffi::OsStr::new))
        };
        for argv in [
            &["exec"][..],
            &["exec", "--tyy", "bash"],
            &["run", "--bogus", "true"],
            &["shell", "--bogus"],
            &["agent"],
            &["nested-exec", "--cpus", "x", "true"],
        ] {
            assert_eq!(exit_code(argv), cli::OWN_FAILURE, "{argv:?}");
        }
        // Elsewhere, clap's: 2 for a refusal, 0 for the help asked for.
        assert_eq!(exit_code(&["ps", "--bogus"]), 2);
        assert_eq!(exit_code(&["bogus"]), 2);
        assert_eq!(exit_code(&[]), 2);
        assert_eq!(exit_code(&["exec", "--help"]), 0);
        assert_eq!(exit_code(&["--version"]), 0);
    }
}
