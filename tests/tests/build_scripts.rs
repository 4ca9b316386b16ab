//! The build scripts' shared shell functions (`scripts/lib/`), run by bash as the
//! scripts run them: which Debian mirror a root filesystem comes from, which virtiofsd
//! setup checks, whether setup's cargo is new enough, whose a cache is when root builds
//! into it; and as whom root builds the guest agent for a user. No VM.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use vm_tests::host_user::{current_uid, unprivileged_user};
use vm_tests::{stderr, stdout, workspace_root, TempDir};

/// Runs `script` in bash after sourcing `scripts/lib/<lib>`, with `input` on stdin and
/// `env` added; returns its stdout. Panics if bash fails.
fn run_lib(lib: &str, script: &str, input: &str, env: &[(&str, &str)]) -> String {
    let lib = workspace_root().join("scripts/lib").join(lib);
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(format!("set -euo pipefail; source \"$0\"; {script}"))
        .arg(&lib)
        // What the libraries read comes only from `env`, never from the developer's
        // shell (setup's own warning advises setting VMCTL_VIRTIOFSD).
        .env_remove("VMCTL_VIRTIOFSD")
        .env_remove("SUDO_UID")
        .env_remove("SUDO_GID")
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run bash");
    child
        .stdin
        .take()
        .expect("bash's stdin")
        .write_all(input.as_bytes())
        .expect("write bash's stdin");
    let output = child.wait_with_output().expect("wait for bash");
    assert!(
        output.status.success(),
        "{script} (after sourcing {}) failed: {}",
        lib.display(),
        stderr(&output)
    );
    stdout(&output)
}

/// `apt-cache policy` on a Debian 12 host with Docker's and MongoDB's repositories, a
/// cloud image's `mirror+file:` source and a local mirror; a third-party URL first.
const POLICY: &str = "\
Package files:
 100 /var/lib/dpkg/status
     release a=now
 500 https://download.docker.com/linux/debian bookworm/stable amd64 Packages
     release o=Docker,a=bookworm,l=Docker CE,c=stable,b=amd64
     origin download.docker.com
 500 https://repo.mongodb.org/apt/debian bookworm/mongodb-org/7.0/main amd64 Packages
     release v=7.0,o=mongodb,a=bookworm,n=bookworm,l=mongodb,c=main,b=amd64
     origin repo.mongodb.org
 500 mirror+file:/etc/apt/mirrors/debian.list bookworm/main amd64 Packages
     release v=12.5,o=Debian,a=stable,n=bookworm,l=Debian,c=main,b=amd64
     origin deb.debian.org
 100 http://mirror.example/debian/ bookworm-backports/main amd64 Packages
     release o=Debian Backports,a=stable-backports,n=bookworm-backports,l=Debian Backports,c=main,b=amd64
 500 http://security.example/debian-security bookworm-security/main amd64 Packages
     release v=12,o=Debian,a=stable-security,n=bookworm-security,l=Debian-Security,c=main,b=amd64
 500 http://mirror.example/debian/ bookworm-updates/main amd64 Packages
     release v=12-updates,o=Debian,a=stable-updates,n=bookworm-updates,l=Debian,c=main,b=amd64
 500 http://other.example/debian bookworm/contrib amd64 Packages
     release v=12.5,o=Debian,a=stable,n=bookworm,l=Debian,c=contrib,b=amd64
 500 http://mirror.example/debian/ bookworm/main amd64 Packages
     release v=12.5,o=Debian,a=stable,n=bookworm,l=Debian,c=main,b=amd64
Pinned packages:
";

fn mirror(suite: &str, label: &str, policy: &str) -> String {
    run_lib(
        "debian-mirror.sh",
        &format!("debian_mirror_from_policy {suite} {label}"),
        policy,
        &[],
    )
}

#[test]
fn the_debian_mirror_is_debians_own_never_a_third_party_one() {
    assert_eq!(
        mirror("bookworm", "Debian", POLICY),
        "http://mirror.example/debian\n"
    );
    assert_eq!(
        mirror("bookworm-security", "Debian-Security", POLICY),
        "http://security.example/debian-security\n"
    );
    // A host of another Debian release: a mirror of Debian's all the same.
    assert_eq!(
        mirror("trixie", "Debian", POLICY),
        "http://mirror.example/debian\n"
    );
    // Only third-party repositories and what the image's apt could not follow: none,
    // and the build falls back to deb.debian.org.
    let foreign: String = POLICY
        .lines()
        .take(12)
        .map(|line| format!("{line}\n"))
        .collect();
    assert!(foreign.contains("mirror+file:") && !foreign.contains("mirror.example"));
    assert_eq!(mirror("bookworm", "Debian", &foreign), "");
}

/// An executable file that prints `line` for `--version`.
fn fake_virtiofsd(path: &Path, line: &str) {
    std::fs::create_dir_all(path.parent().expect("a parent")).expect("create its directory");
    std::fs::write(path, format!("#!/bin/sh\necho '{line}'\n")).expect("write it");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod it");
}

/// Which virtiofsd `vmctl_virtiofsd` names, searching `path` (run from `cwd`, for the
/// relative entries) with `home`, and `explicit` as VMCTL_VIRTIOFSD.
fn setup_finds(cwd: &Path, path: &str, home: &Path, explicit: Option<&str>) -> String {
    // The search runs tools (timeout, head): it needs this process's PATH.
    let mut env = vec![
        ("SEARCHED_PATH", path),
        ("HOME", home.to_str().expect("utf-8")),
        ("CWD", cwd.to_str().expect("utf-8")),
    ];
    if let Some(explicit) = explicit {
        env.push(("VMCTL_VIRTIOFSD", explicit));
    }
    run_lib(
        "virtiofsd.sh",
        "cd \"$CWD\" && vmctl_virtiofsd \"$SEARCHED_PATH\"",
        "",
        &env,
    )
}

/// setup names the virtiofsd vmctl runs (`vmctl/src/virtiofsd/binary.rs`): the first
/// executable one of 1.14.0 or later, passing over older ones and QEMU's C one as vmctl
/// does, so it neither warns about one vmctl skips nor installs over a newer one.
#[test]
fn setup_checks_the_virtiofsd_vmctl_will_find() {
    let dir = TempDir::new("virtiofsd-search");
    let home = dir.join("home");
    let plain = dir.join("plain");
    let old = dir.join("old");
    let qemu = dir.join("qemu");
    let newer = dir.join("newer");
    std::fs::create_dir_all(&plain).expect("create a PATH directory");
    // Not executable: skipped, as vmctl skips it.
    std::fs::write(plain.join("virtiofsd"), "").expect("write a plain file");
    fake_virtiofsd(&old.join("virtiofsd"), "virtiofsd 1.10.0");
    fake_virtiofsd(
        &qemu.join("virtiofsd"),
        "virtiofsd version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)",
    );
    fake_virtiofsd(&newer.join("virtiofsd"), "virtiofsd 1.15.0-rc1");
    fake_virtiofsd(&home.join(".cargo/bin/virtiofsd"), "virtiofsd 1.14.0");
    // vmctl ignores relative PATH entries (the working directory's): this one would
    // be taken first.
    fake_virtiofsd(&dir.join("relative/virtiofsd"), "virtiofsd 1.14.0");
    let path = |dirs: &[&Path]| {
        let mut dirs: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        dirs.insert(0, "relative".into());
        dirs.join(":")
    };
    let cargo_one = format!("{}\n", home.join(".cargo/bin/virtiofsd").display());
    // An older one and QEMU's on PATH: passed over for ~/.cargo/bin's.
    assert_eq!(
        setup_finds(dir.path(), &path(&[&plain, &old, &qemu]), &home, None),
        cargo_one
    );
    // A newer one than setup installs, first: the one vmctl runs, accepted.
    assert_eq!(
        setup_finds(dir.path(), &path(&[&old, &newer]), &home, None),
        format!("{}\n", newer.join("virtiofsd").display())
    );
    // None recent anywhere: nothing, and setup installs one.
    assert_eq!(
        setup_finds(dir.path(), &path(&[&old]), &dir.join("nohome"), None),
        ""
    );
    // VMCTL_VIRTIOFSD as it is, found or not, old or not: vmctl uses or refuses it.
    assert_eq!(
        setup_finds(dir.path(), &path(&[&newer]), &home, Some("/x/vfs")),
        "/x/vfs\n"
    );
}

/// setup's reading of a virtiofsd's `--version` line is vmctl's (`parse_version`):
/// "virtiofsd X.Y.Z", each part from its leading digits, 1.14.0 or later.
#[test]
fn setup_reads_virtiofsd_versions_as_vmctl_does() {
    let dir = TempDir::new("virtiofsd-versions");
    let binary = dir.join("virtiofsd");
    for (line, recent) in [
        ("virtiofsd 1.14.0", true),
        ("virtiofsd 1.14.2", true),
        ("virtiofsd 1.15.0", true),
        ("virtiofsd 2.0.0-rc1", true),
        ("  virtiofsd 1.14.08", true),
        ("virtiofsd 1.13.9", false),
        ("virtiofsd 0.99.99", false),
        ("virtiofsd 1.14", false),
        ("virtiofsd  1.14.0", false),
        (
            "virtiofsd version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)",
            false,
        ),
        ("", false),
    ] {
        fake_virtiofsd(&binary, line);
        let said = run_lib(
            "virtiofsd.sh",
            "if virtiofsd_is_recent \"$BINARY\"; then echo recent; else echo old; fi",
            "",
            &[("BINARY", binary.to_str().expect("utf-8"))],
        );
        assert_eq!(said.trim() == "recent", recent, "{line:?}: {said}");
    }
}

#[test]
fn setup_sees_apparmors_user_namespace_restriction() {
    let dir = TempDir::new("apparmor-sysctl");
    let sysctl = dir.join("apparmor_restrict_unprivileged_userns");
    let restricted = |contents: Option<&str>| {
        match contents {
            Some(contents) => std::fs::write(&sysctl, contents).expect("write the sysctl"),
            None => {
                let _ = std::fs::remove_file(&sysctl);
            }
        }
        run_lib(
            "virtiofsd.sh",
            "if apparmor_restricts_userns \"$SYSCTL\"; then echo yes; else echo no; fi",
            "",
            &[("SYSCTL", sysctl.to_str().expect("utf-8"))],
        )
    };
    assert_eq!(restricted(Some("1\n")), "yes\n");
    assert_eq!(restricted(Some("0\n")), "no\n");
    // A kernel without AppArmor's restriction has no such sysctl.
    assert_eq!(restricted(None), "no\n");
}

/// The profile names the file vmctl runs, its links resolved (AppArmor attaches a
/// profile to the file executed), and allows user namespaces; a path AppArmor would
/// read as a pattern gets none.
#[test]
fn setup_writes_the_readmes_apparmor_profile_for_the_file_vmctl_runs() {
    let dir = TempDir::new("apparmor-profile");
    let binary = dir.join("cargo home/bin/virtiofsd");
    fake_virtiofsd(&binary, "virtiofsd 1.14.0");
    let link = dir.join("virtiofsd-link");
    std::os::unix::fs::symlink(&binary, &link).expect("link to it");
    let profile = run_lib(
        "virtiofsd.sh",
        "virtiofsd_apparmor_profile \"$BINARY\"",
        "",
        &[("BINARY", link.to_str().expect("utf-8"))],
    );
    let resolved = std::fs::canonicalize(&binary).expect("resolve it");
    assert!(
        profile.contains(&format!(
            "profile virtiofsd \"{}\" flags=(unconfined) {{\n  userns,\n}}\n",
            resolved.display()
        )) && profile.contains("abi <abi/4.0>,\ninclude <tunables/global>\n"),
        "{profile}"
    );
    let pattern = dir.join("bin*/virtiofsd");
    fake_virtiofsd(&pattern, "virtiofsd 1.14.0");
    let refused = run_lib(
        "virtiofsd.sh",
        "virtiofsd_apparmor_profile \"$BINARY\" || echo refused",
        "",
        &[("BINARY", pattern.to_str().expect("utf-8"))],
    );
    assert_eq!(refused, "refused\n");
}

/// Installing the profile: written and loaded through the prefix (sudo), left alone
/// once there and loaded, loaded again once not; someone's own profile that names the
/// binary is kept, and one that does not is not overwritten.
#[test]
fn setup_installs_the_apparmor_profile_through_sudo_and_only_its_own() {
    let dir = TempDir::new("apparmor-install");
    let binary = dir.join("bin/virtiofsd");
    fake_virtiofsd(&binary, "virtiofsd 1.14.0");
    let profile_file = dir.join("apparmor.d/virtiofsd");
    std::fs::create_dir_all(profile_file.parent().expect("a parent")).expect("mkdir");
    let loaded = dir.join("profiles");
    let calls = dir.join("calls");
    // The prefix (sudo) and apparmor_parser, each noting how it was run.
    let tools = dir.join("tools");
    std::fs::create_dir_all(&tools).expect("mkdir tools");
    for (name, body) in [
        ("fake-sudo", "echo \"sudo $*\" >>\"$CALLS\"\nexec \"$@\"\n"),
        (
            "apparmor_parser",
            "echo \"apparmor_parser $*\" >>\"$CALLS\"\n",
        ),
    ] {
        let tool = tools.join(name);
        std::fs::write(&tool, format!("#!/bin/sh\n{body}")).expect("write a tool");
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755))
            .expect("chmod a tool");
    }
    let searched_path = format!(
        "{}:{}",
        tools.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let install = || {
        let _ = std::fs::remove_file(&calls);
        let said = run_lib(
            "virtiofsd.sh",
            "virtiofsd_apparmor_file=\"$PROFILE\" virtiofsd_apparmor_loaded=\"$LOADED\" \
             PATH=\"$SEARCHED_PATH\"; \
             virtiofsd_apparmor_install \"$BINARY\" fake-sudo || echo failed",
            "",
            &[
                ("PROFILE", profile_file.to_str().expect("utf-8")),
                ("LOADED", loaded.to_str().expect("utf-8")),
                ("CALLS", calls.to_str().expect("utf-8")),
                ("SEARCHED_PATH", &searched_path),
                ("BINARY", binary.to_str().expect("utf-8")),
            ],
        );
        let calls = std::fs::read_to_string(&calls).unwrap_or_default();
        (said, calls)
    };
    let profile_path = profile_file.display();
    // Nothing loaded yet.
    std::fs::write(&loaded, "other (enforce)\n").expect("write the loaded list");
    let (said, calls) = install();
    assert_eq!(said, "installed\n");
    assert_eq!(
        calls,
        format!(
            "sudo tee -- {profile_path}\nsudo apparmor_parser -r {profile_path}\n\
             apparmor_parser -r {profile_path}\n"
        )
    );
    let written = std::fs::read_to_string(&profile_file).expect("read the profile");
    let resolved = std::fs::canonicalize(&binary).expect("resolve it");
    assert!(
        written.starts_with("# Written by vmctl's scripts/setup.sh")
            && written.contains(&format!("profile virtiofsd \"{}\"", resolved.display())),
        "{written}"
    );
    // Written but not loaded (the load failed, or the list was emptied): loaded again.
    let (said, _) = install();
    assert_eq!(said, "installed\n");
    // Loaded: nothing run, nothing asked of sudo.
    std::fs::write(&loaded, "other (enforce)\nvirtiofsd (unconfined)\n").expect("write");
    assert_eq!(install(), ("up to date\n".to_string(), String::new()));
    // The loaded list cannot be read (only root may): the file is trusted.
    std::fs::remove_file(&loaded).expect("remove the loaded list");
    assert_eq!(install(), ("up to date\n".to_string(), String::new()));
    // A profile made by hand from the README for this binary: kept.
    let own = format!(
        "abi <abi/4.0>,\ninclude <tunables/global>\nprofile virtiofsd {} flags=(unconfined) {{\n  userns,\n}}\n",
        resolved.display()
    );
    std::fs::write(&profile_file, &own).expect("write an own profile");
    assert_eq!(install(), ("kept\n".to_string(), String::new()));
    // Someone's profile for another file: not setup's to replace.
    let other = own.replace(&resolved.display().to_string(), "/opt/elsewhere/virtiofsd");
    std::fs::write(&profile_file, &other).expect("write another profile");
    assert_eq!(install(), ("failed\n".to_string(), String::new()));
    assert_eq!(
        std::fs::read_to_string(&profile_file).expect("read it"),
        other
    );
}

/// What `rust_pinned_version` reads from a rust-toolchain.toml holding `toml`
/// ("none" where it pins no release).
fn pinned_in(dir: &TempDir, toml: &str) -> String {
    let file = dir.join("rust-toolchain.toml");
    std::fs::write(&file, toml).expect("write rust-toolchain.toml");
    run_lib(
        "rust-toolchain.sh",
        "rust_pinned_version \"$TOML\" || echo none",
        "",
        &[("TOML", file.to_str().expect("utf-8"))],
    )
}

/// setup checks cargo against the release this checkout's rust-toolchain.toml pins,
/// read from the file, so that the check follows the pin; a channel without a version
/// pins none.
#[test]
fn setup_reads_the_release_rust_toolchain_toml_pins() {
    let toml = workspace_root().join("rust-toolchain.toml");
    let pinned = run_lib(
        "rust-toolchain.sh",
        "rust_pinned_version \"$TOML\"",
        "",
        &[("TOML", toml.to_str().expect("utf-8"))],
    );
    let written = std::fs::read_to_string(&toml).expect("read rust-toolchain.toml");
    assert!(
        pinned
            .trim()
            .split('.')
            .all(|part| part.parse::<u32>().is_ok())
            && written.contains(&format!("channel = \"{}\"", pinned.trim())),
        "{} pins {pinned:?}, which setup cannot check cargo against: pin a release \
         (channel = \"X.Y.Z\")",
        toml.display()
    );

    let dir = TempDir::new("rust-toolchain-toml");
    for (toml, pinned) in [
        (
            "[toolchain]\nchannel = \"1.95.0\"\ncomponents = [\"clippy\"]\n",
            "1.95.0\n",
        ),
        ("[toolchain]\n  channel=\"1.96\"  # the MSRV\n", "1.96\n"),
        ("[toolchain]\nchannel = \"1.97.1\"", "1.97.1\n"),
        ("[toolchain]\nchannel = \"stable\"\n", "none\n"),
        ("[toolchain]\nchannel = \"nightly-2026-01-01\"\n", "none\n"),
        ("[toolchain]\ncomponents = [\"clippy\"]\n", "none\n"),
    ] {
        assert_eq!(pinned_in(&dir, toml), pinned, "{toml:?}");
    }
}

/// An executable stand-in for cargo at `path`, running `body` (sh).
fn fake_cargo(path: &Path, body: &str) {
    std::fs::write(path, format!("#!/bin/sh\n{body}\n")).expect("write the fake cargo");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .expect("chmod the fake cargo");
}

/// setup's check of its cargo (`rust_toolchain_problem`): at least the release the
/// checkout pins, as `cargo --version` says it in the checkout, where rustup applies
/// the pin (installing it first, with its progress on stderr); an older one (Debian's)
/// is refused, naming the version found, the one needed and rustup.
#[test]
fn setup_refuses_a_cargo_older_than_the_release_the_checkout_pins() {
    let dir = TempDir::new("rust-toolchain-check");
    let checkout = dir.join("checkout");
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir_all(&checkout).expect("create the checkout");
    std::fs::create_dir_all(&elsewhere).expect("create another directory");
    std::fs::write(
        checkout.join("rust-toolchain.toml"),
        "[toolchain]\nchannel = \"1.95.0\"\n",
    )
    .expect("write rust-toolchain.toml");
    let cargo = dir.join("cargo");
    // Run from another directory, as setup may be.
    let problem = |body: &str| {
        fake_cargo(&cargo, body);
        run_lib(
            "rust-toolchain.sh",
            "cd \"$ELSEWHERE\" && { rust_toolchain_problem \"$CHECKOUT\" \"$CARGO\" || echo refused; }",
            "",
            &[
                ("ELSEWHERE", elsewhere.to_str().expect("utf-8")),
                ("CHECKOUT", checkout.to_str().expect("utf-8")),
                ("CARGO", cargo.to_str().expect("utf-8")),
            ],
        )
    };
    for new_enough in [
        "cargo 1.95.0 (f2d3ce0bd 2026-03-21)",
        "cargo 1.95.3",
        "cargo 1.96.0-nightly (0123abc 2026-04-01)",
        "cargo 1.100.0 (0123abc 2027-01-01)",
        "cargo 2.0.0",
    ] {
        assert_eq!(problem(&format!("echo '{new_enough}'")), "", "{new_enough}");
    }
    // Debian 12's, and one a release short.
    for (too_old, found) in [
        ("cargo 1.65.0", "1.65.0"),
        ("cargo 1.94.1 (0123abc 2026-02-01)", "1.94.1"),
    ] {
        let said = problem(&format!("echo '{too_old}'"));
        assert!(
            said.contains(&format!("cargo {found} ({})", cargo.display()))
                && said.contains("needs Rust 1.95.0 or later")
                && said.contains("https://rustup.rs")
                && said.ends_with("refused\n"),
            "{too_old}: {said}"
        );
    }
    // rustup: the pinned release only where rust-toolchain.toml is, downloaded first,
    // saying so on stderr (on stdout would be no version line either way).
    let rustup = "if [ -f rust-toolchain.toml ]; then \
                      echo \"info: downloading component 'cargo'\" >&2; \
                      echo 'cargo 1.95.0 (f2d3ce0bd 2026-03-21)'; \
                  else echo 'cargo 1.65.0'; fi";
    assert_eq!(problem(rustup), "");
    // A cargo that fails (rustup that cannot fetch the release), or says no version.
    let said = problem("echo \"error: toolchain '1.95.0' is not installed\" >&2; exit 1");
    assert!(
        said.contains("failed or said no version") && said.contains("1.95.0 or later"),
        "{said}"
    );
    let said = problem("echo 'rustup-init 1.29.0'");
    assert!(said.contains("failed or said no version"), "{said}");
    // None at all.
    let said = run_lib(
        "rust-toolchain.sh",
        "rust_toolchain_problem \"$CHECKOUT\" no-such-cargo-anywhere || echo refused",
        "",
        &[("CHECKOUT", checkout.to_str().expect("utf-8"))],
    );
    assert!(
        said.starts_with("cargo is missing; this checkout needs Rust 1.95.0 or later")
            && said.contains("https://rustup.rs"),
        "{said}"
    );
}

#[test]
fn a_cache_is_its_owners_when_root_builds_into_it_under_sudo() {
    let dir = TempDir::new("cache-owner");
    let not_yet_made = dir.join("home/.cache/vmctl");
    let owner = |sudo_uid: &str, cache: &Path| {
        run_lib(
            "cache.sh",
            "cache_owner \"$CACHE\"",
            "",
            &[
                ("SUDO_UID", sudo_uid),
                ("SUDO_GID", "4321"),
                ("CACHE", cache.to_str().expect("utf-8")),
            ],
        )
    };
    if current_uid() != 0 {
        // Only root builds for another user.
        assert_eq!(owner("1234", &not_yet_made), "");
        vm_tests::record_check_not_made(
            "build_scripts::a_cache_is_its_owners_when_root_builds_into_it_under_sudo, \
             root's half",
            "only root builds for another user, and these tests do not run as root",
        );
        return;
    }
    // The nearest existing directory decides: the user's home, theirs.
    std::fs::create_dir_all(dir.join("home")).expect("create the home");
    let chown = Command::new("chown")
        .arg("1234")
        .arg(dir.join("home"))
        .status()
        .expect("run chown");
    assert!(chown.success(), "chown 1234 failed");
    assert_eq!(owner("1234", &not_yet_made), "1234:4321\n");
    // Root's own cache (sudo's HOME=/root) stays root's; so does plain root's.
    assert_eq!(owner("1234", dir.path()), "");
    assert_eq!(owner("0", &not_yet_made), "");
}

/// Runs `guest-agent/build-initramfs.sh` as root for the user `sudo_uid`, into `cache`,
/// with `target_dir` as cargo's target directory and a cargo that only says whose it
/// ran as and fails; returns the script's stderr.
fn agent_build_for(
    dir: &TempDir,
    sudo_uid: u32,
    sudo_gid: u32,
    cache: &Path,
    target_dir: &Path,
) -> String {
    let cargo = dir.join("fake-cargo");
    if !cargo.exists() {
        std::fs::write(
            &cargo,
            "#!/bin/sh\necho \"fake cargo ran as uid $(id -u)\" >&2\nexit 3\n",
        )
        .expect("write the fake cargo");
        std::fs::set_permissions(&cargo, std::fs::Permissions::from_mode(0o755))
            .expect("chmod the fake cargo");
    }
    let output = Command::new("bash")
        .arg(workspace_root().join("guest-agent/build-initramfs.sh"))
        .env("SUDO_UID", sudo_uid.to_string())
        .env("SUDO_GID", sudo_gid.to_string())
        .env("VMCTL_CACHE_DIR", cache)
        .env("CARGO_TARGET_DIR", target_dir)
        .env("CARGO", &cargo)
        .env_remove("CARGO_HOME")
        .stdin(Stdio::null())
        .output()
        .expect("run guest-agent/build-initramfs.sh");
    assert!(!output.status.success(), "the fake cargo fails the build");
    stderr(&output)
}

fn chown(path: &Path, uid: u32, gid: u32) {
    let status = Command::new("chown")
        .arg("-R")
        .arg(format!("{uid}:{gid}"))
        .arg(path)
        .status()
        .expect("run chown");
    assert!(status.success(), "chown -R {} failed", path.display());
}

/// Root building the agent into a user's cache builds as that user, except where they
/// could not: their cargo would fail on a target directory root made (or a file in
/// the agent's part of it), and a SUDO_UID that names no account has no home or
/// groups to build with. Root then builds, saying why.
#[test]
fn the_agent_is_built_as_the_caches_owner_only_where_they_could_build_it() {
    if current_uid() != 0 {
        vm_tests::record_check_not_made(
            "build_scripts::the_agent_is_built_as_the_caches_owner_only_where_they_could_build_it",
            "only root builds for another user, and these tests do not run as root",
        );
        return;
    }
    let user = unprivileged_user();
    let dir = TempDir::new("agent-owner");
    let cache = dir.join("cache");
    std::fs::create_dir_all(&cache).expect("create the cache");
    chown(&cache, user.uid, user.gid);
    let target_dir = dir.join("target");
    let agent_dir = target_dir.join("x86_64-unknown-linux-gnu/guest-agent");
    std::fs::create_dir_all(&agent_dir).expect("create the target directory");
    let ran_as = |uid: u32| format!("fake cargo ran as uid {uid}\n");

    // Root's target directory (setup's vmctl build, as root, made it): root builds.
    let said = agent_build_for(&dir, user.uid, user.gid, &cache, &target_dir);
    assert!(
        said.contains(&format!("they could not write {}", target_dir.display()))
            && said.contains("building as root")
            && said.contains(&ran_as(0)),
        "{said}"
    );

    // Theirs: built as them.
    chown(&target_dir, user.uid, user.gid);
    let said = agent_build_for(&dir, user.uid, user.gid, &cache, &target_dir);
    assert!(
        said.contains("building as that user") && said.contains(&ran_as(user.uid)),
        "{said}"
    );

    // Theirs but for a lock root left in the agent's part: root builds.
    let lock = agent_dir.join(".cargo-lock");
    std::fs::write(&lock, "").expect("write a lock");
    let said = agent_build_for(&dir, user.uid, user.gid, &cache, &target_dir);
    assert!(
        said.contains(&format!("they could not write {}", lock.display()))
            && said.contains(&ran_as(0)),
        "{said}"
    );
    std::fs::remove_file(&lock).expect("remove the lock");

    // A SUDO_UID no account has: root builds.
    let nobody_uid = (4_000_000..4_001_000)
        .find(|uid| {
            !Command::new("getent")
                .args(["passwd", &uid.to_string()])
                .stdout(Stdio::null())
                .status()
                .expect("run getent")
                .success()
        })
        .expect("a uid without an account");
    chown(&cache, nobody_uid, nobody_uid);
    chown(&target_dir, nobody_uid, nobody_uid);
    let said = agent_build_for(&dir, nobody_uid, nobody_uid, &cache, &target_dir);
    assert!(
        said.contains("which names no account: building as root") && said.contains(&ran_as(0)),
        "{said}"
    );
}

/// Root building a kernel or an image into a user's cache builds as them, unless an
/// earlier build as root left something there they could not write (a lock, an entry,
/// a work directory): their build would fail on it, so root builds and says how to
/// give the cache back.
#[test]
fn builds_stay_root_where_the_cache_holds_what_its_owner_cannot_write() {
    if current_uid() != 0 {
        vm_tests::record_check_not_made(
            "build_scripts::builds_stay_root_where_the_cache_holds_what_its_owner_cannot_write",
            "only root builds for another user, and these tests do not run as root",
        );
        return;
    }
    let user = unprivileged_user();
    let dir = TempDir::new("cache-unwritable");
    let cache = dir.join("cache");
    let kernels = cache.join("kernel");
    std::fs::create_dir_all(&kernels).expect("create the cache");
    chown(&cache, user.uid, user.gid);
    let build = || {
        let output = Command::new("bash")
            .arg("-c")
            .arg(
                "set -euo pipefail; source \"$0\"; \
                 cache_build_as_owner \"$CACHE\" kernel bash -c 'echo \"built as $(id -u)\"'; \
                 echo \"built as $(id -u)\"",
            )
            .arg(workspace_root().join("scripts/lib/cache.sh"))
            .env("SUDO_UID", user.uid.to_string())
            .env("SUDO_GID", user.gid.to_string())
            .env("CACHE", &cache)
            .stdin(Stdio::null())
            .output()
            .expect("run bash");
        assert!(output.status.success(), "{}", stderr(&output));
        (stdout(&output), stderr(&output))
    };

    let (built, said) = build();
    assert_eq!(built, format!("built as {}\n", user.uid), "{said}");

    // What a failed build as root left among another kind's entries is not this
    // build's to write: it still runs as the user.
    let images = cache.join("rootfs");
    std::fs::create_dir_all(&images).expect("create the images' directory");
    chown(&images, user.uid, user.gid);
    std::fs::write(images.join("base-0123456789abcdef.failed.log"), "").expect("write a log");
    let (built, said) = build();
    assert_eq!(built, format!("built as {}\n", user.uid), "{said}");

    // A lock an earlier build as root left among the kernels.
    let lock = kernels.join(".guest.lock");
    std::fs::write(&lock, "").expect("write a root-owned lock");
    let (built, said) = build();
    assert_eq!(built, "built as 0\n", "{said}");
    assert!(
        said.contains(&format!("they could not write {}", lock.display()))
            && said.contains(&format!("sudo chown -R {} ", user.uid)),
        "{said}"
    );
}

/// A recipe is checked before anything is built, with one message per kind of mistake
/// (one `jq` reads it all: every VM start runs this script); a string of the recipe
/// never reaches the shell as code.
#[test]
fn a_root_image_recipe_is_checked_before_any_build() {
    let dir = TempDir::new("recipes");
    let script = workspace_root().join("rootfs/build-rootfs.sh");
    let check = |name: &str, recipe: &str| {
        let path = dir.path().join(format!("{name}.recipe"));
        std::fs::write(&path, recipe).unwrap();
        let output = Command::new(&script)
            .arg(&path)
            .arg("--print-path")
            .env("VMCTL_CACHE_DIR", dir.path().join("cache"))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (output.status.success(), stdout(&output), stderr(&output))
    };
    let refused = |name: &str, recipe: &str, says: &str| {
        let (ok, _, said) = check(name, recipe);
        assert!(!ok && said.contains(says), "{name}: {said}");
    };
    refused("not-json", "x{", "is not a JSON object");
    refused("array", "[1]", "is not a JSON object");
    refused(
        "unknown",
        r#"{"name": "a", "foo": 1, "bar": 2}"#,
        "unknown field(s): bar, foo (known: name,",
    );
    let types = "'name' must be a string, 'debian_packages' and 'npm_packages' arrays";
    refused("types", r#"{"name": 1}"#, types);
    refused(
        "packages",
        r#"{"name": "a", "debian_packages": "curl"}"#,
        types,
    );
    refused("name", r#"{"name": "a b"}"#, "name 'a b' must match");
    refused("two-lines", r#"{"name": "a\nb"}"#, "must match");
    refused(
        "package",
        r#"{"name": "a", "debian_packages": ["curl\nvim"]}"#,
        "is not a Debian package name",
    );
    let planted = dir.path().join("planted");
    refused(
        "code",
        &format!(
            r#"{{"name": "a", "npm_packages": ["$(touch {})", "x'; touch {}; '"]}}"#,
            planted.display(),
            planted.display()
        ),
        "is not an npm package spec",
    );
    assert!(!planted.exists(), "a recipe's string ran as shell code");
    refused(
        "script",
        r#"{"name": "a", "script": "missing.sh"}"#,
        "script 'missing.sh' not found",
    );
    let (ok, path, said) = check(
        "good",
        r#"{"name": "good", "debian_packages": ["curl=7.88.1-10"], "npm_packages": ["@scope/x@1"]}"#,
    );
    assert!(ok, "{said}");
    let path = path.trim();
    assert!(
        path.starts_with(&dir.path().join("cache/rootfs/good-").display().to_string())
            && path.ends_with("/rootfs.ext4"),
        "{path}"
    );
}

/// A month's root image that a VM's start cannot build (no root, no network, a mirror
/// down) gives way to the newest image of an earlier month of the same recipe, with a
/// warning; a build that failed is not tried again at each start for an hour; without
/// an earlier image, the build fails as before. (Review: the image's key did not
/// follow Debian's archive, so no image took a security update until a build script
/// changed.) An explicit build (no VMCTL_ROOTFS_FALLBACK) fails, and tries again at
/// once. (Review: the command the warning gives, run after a fix, printed the old
/// image for an hour, and `vmctl image build` without root succeeded with it.)
#[test]
fn a_months_image_that_cannot_be_built_gives_way_to_an_earlier_months() {
    if current_uid() != 0 {
        vm_tests::record_check_not_made(
            "build_scripts::a_months_image_that_cannot_be_built_gives_way_to_an_earlier_months",
            "building a root image needs root, and these tests do not run as root",
        );
        return;
    }
    let dir = TempDir::new("rootfs-month");
    let fake_bin = dir.path().join("bin");
    std::fs::create_dir_all(&fake_bin).unwrap();
    let mmdebstrap = fake_bin.join("mmdebstrap");
    std::fs::write(
        &mmdebstrap,
        "#!/bin/sh\necho 'E: cannot reach the mirror' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&mmdebstrap, std::fs::Permissions::from_mode(0o755)).unwrap();
    // Read by the unprivileged user below, as a user's own cache would be.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        fake_bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // The scripts, where the unprivileged user can read them (a checkout under
    // /root, 0700, is not).
    let sources = dir.path().join("src");
    for (from, to) in [
        ("rootfs/build-rootfs.sh", "rootfs/build-rootfs.sh"),
        ("scripts/lib/cache.sh", "scripts/lib/cache.sh"),
        (
            "scripts/lib/debian-mirror.sh",
            "scripts/lib/debian-mirror.sh",
        ),
        (
            "scripts/lib/rootfs-as-root.sh",
            "scripts/lib/rootfs-as-root.sh",
        ),
    ] {
        let to = sources.join(to);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(workspace_root().join(from), &to).unwrap();
    }
    let script = sources.join("rootfs/build-rootfs.sh");
    let user = unprivileged_user();
    let build_as = |recipe_name: &str, month: &str, how: &str, for_a_start: bool| {
        let recipe = dir.path().join(format!("{recipe_name}.recipe"));
        std::fs::write(&recipe, format!(r#"{{"name": "{recipe_name}"}}"#)).unwrap();
        let mut command = match how {
            "as a user" => {
                let mut command = Command::new("setpriv");
                command
                    .arg(format!("--reuid={}", user.uid))
                    .arg(format!("--regid={}", user.gid))
                    .arg("--clear-groups")
                    .arg(&script);
                command
            }
            _ => Command::new(&script),
        };
        command.arg(&recipe);
        if how == "print" {
            command.arg("--print-path");
        }
        if for_a_start {
            command.env("VMCTL_ROOTFS_FALLBACK", "1");
        } else {
            command.env_remove("VMCTL_ROOTFS_FALLBACK");
        }
        let output = command
            .env("VMCTL_CACHE_DIR", dir.path().join("cache"))
            .env("VMCTL_ROOTFS_MONTH", month)
            .env("PATH", &path)
            .env_remove("SUDO_UID")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (output.status.success(), stdout(&output), stderr(&output))
    };
    let build = |recipe_name: &str, month: &str, how: &str| build_as(recipe_name, month, how, true);
    let (_, earlier, _) = build("kept", "2000-01", "print");
    let earlier = PathBuf::from(earlier.trim());
    std::fs::create_dir_all(earlier.parent().unwrap()).unwrap();
    std::fs::write(&earlier, "an earlier month's image").unwrap();
    // A later month's is no fallback for an earlier one.
    let (_, later, _) = build("kept", "2000-03", "print");
    let later = PathBuf::from(later.trim());
    std::fs::create_dir_all(later.parent().unwrap()).unwrap();
    std::fs::write(&later, "a later month's image").unwrap();
    let (_, this_month, _) = build("kept", "2000-02", "print");
    assert_ne!(
        this_month.trim(),
        earlier.to_str().unwrap(),
        "one key for two months"
    );

    // Without root, at once.
    let (ok, printed, said) = build("kept", "2000-02", "as a user");
    assert!(
        ok,
        "failed as a user with an earlier month's image there: {said}"
    );
    assert_eq!(printed.trim(), earlier.to_str().unwrap(), "{said}");
    assert!(
        said.contains("warning: using the image of 2000-01") && said.contains("needs root"),
        "{said}"
    );

    let (ok, printed, said) = build("kept", "2000-02", "as root");
    assert!(ok, "failed with an earlier month's image there: {said}");
    assert_eq!(printed.trim(), earlier.to_str().unwrap(), "{said}");
    assert!(
        said.contains("E: cannot reach the mirror")
            && said.contains("warning: using the image of 2000-01")
            && said.contains("this month's (2000-02) is not built, as its build failed"),
        "{said}"
    );
    // Not tried again at once: it would fail as well, minutes later.
    let (ok, printed, said) = build("kept", "2000-02", "as root");
    assert!(ok && printed.trim() == earlier.to_str().unwrap(), "{said}");
    assert!(
        !said.contains("E: cannot reach the mirror") && said.contains("less than an hour ago"),
        "{said}"
    );
    // Asked for, it is: and fails, with no earlier image standing in.
    let (ok, printed, said) = build_as("kept", "2000-02", "as root", false);
    assert!(!ok, "an explicit build gave {printed}: {said}");
    assert!(
        said.contains("E: cannot reach the mirror") && !said.contains("warning: using the image"),
        "{said}"
    );
    let (ok, printed, said) = build_as("kept", "2000-02", "as a user", false);
    assert!(!ok, "an explicit build without root gave {printed}: {said}");
    assert!(
        said.contains("needs root") && !said.contains("warning: using the image"),
        "{said}"
    );

    let (ok, printed, said) = build("alone", "2000-02", "as root");
    assert!(
        !ok,
        "succeeded with no image to fall back on: {printed} {said}"
    );
    assert!(said.contains("E: cannot reach the mirror"), "{said}");

    let (ok, _, said) = build("kept", "2000-13", "print");
    assert!(!ok && said.contains("is not a month"), "{said}");
}

/// A build keeps its own entry and the two most recently used of older keys, and
/// removes the rest, however recent: each edit of a build script is a new key, and a
/// root image is 1.6 GB. (Review: only entries unused for 30 days went, and at a
/// month's rate of script edits, images of old keys would have filled the disk.)
#[test]
fn a_build_keeps_the_last_used_entries_of_older_keys() {
    let dir = TempDir::new("cache-prune");
    let parent = dir.path().join("rootfs");
    let names = [
        "default-aaaa",
        "default-bbbb",
        "default-cccc",
        "default-dddd",
        "other-eeee",
    ];
    for (age_minutes, name) in [50, 40, 30, 20, 60].iter().zip(names) {
        let entry = parent.join(name);
        std::fs::create_dir_all(&entry).unwrap();
        let status = Command::new("touch")
            .arg("-d")
            .arg(format!("{age_minutes} minutes ago"))
            .arg(&entry)
            .status()
            .unwrap();
        assert!(status.success());
    }
    let current = parent.join("default-aaaa");
    run_lib(
        "cache.sh",
        "cache_prune \"$PARENT\" 'default-????' \"$CURRENT\"",
        "",
        &[
            ("PARENT", parent.to_str().unwrap()),
            ("CURRENT", current.to_str().unwrap()),
        ],
    );
    let mut left: Vec<String> = std::fs::read_dir(&parent)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    // The current one, though the oldest; the two used last; another kind's.
    assert_eq!(
        left,
        ["default-aaaa", "default-cccc", "default-dddd", "other-eeee"]
    );

    // The only other entry, but unused for 30 days: removed too.
    let parent = dir.path().join("kernel");
    let current = parent.join("default-gggg");
    std::fs::create_dir_all(&current).unwrap();
    let stale = parent.join("default-ffff");
    std::fs::create_dir_all(&stale).unwrap();
    let status = Command::new("touch")
        .args(["-d", "31 days ago"])
        .arg(&stale)
        .status()
        .unwrap();
    assert!(status.success());
    run_lib(
        "cache.sh",
        "cache_prune \"$PARENT\" 'default-????' \"$CURRENT\"",
        "",
        &[
            ("PARENT", parent.to_str().unwrap()),
            ("CURRENT", current.to_str().unwrap()),
        ],
    );
    assert!(
        !stale.exists(),
        "an entry unused for 31 days is kept for being among the last used"
    );
    assert!(current.exists());
}

/// A relative VMCTL_CACHE_DIR names a place under the directory the build started in,
/// wherever the build goes on to work. (Review: the kernel's build, run from its work
/// directory, looked for the cache under it.)
#[test]
fn a_relative_cache_directory_is_the_callers() {
    let cwd = std::env::current_dir().unwrap();
    let seen = run_lib(
        "cache.sh",
        "echo \"$VMCTL_CACHE_DIR\"",
        "",
        &[("VMCTL_CACHE_DIR", "some/cache")],
    );
    assert_eq!(seen.trim(), cwd.join("some/cache").to_str().unwrap());
}
