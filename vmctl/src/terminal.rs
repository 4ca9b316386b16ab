//! Terminal plumbing: printable text, output that survives its reader, raw mode for
//! a tty.

use std::io::Write;
use std::os::fd::AsRawFd;

/// Writes vmctl's own output (a listing, a path) to stdout, as print! would, but
/// without panicking when stdout cannot be written (print! does, and vmctl aborts):
/// a reader that went away (`vmctl policy ls | head -1`) ends vmctl quietly with 141,
/// as SIGPIPE ends other tools; any other failure is said on stderr and ends it with 1.
pub fn print_out(text: std::fmt::Arguments) {
    let mut out = std::io::stdout().lock();
    let Err(e) = out.write_fmt(text).and_then(|()| out.flush()) else {
        return;
    };
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(128 + libc::SIGPIPE);
    }
    let _ = writeln!(
        std::io::stderr(),
        "vmctl: error: cannot write to standard output: {e}"
    );
    std::process::exit(1);
}

pub use vmm::process::{one_line, printable};

/// Puts the terminal on `fd` in raw mode (no echo, no line editing, no output
/// translation), so bytes pass between the host and the guest unchanged. Does nothing
/// when `fd` is not a terminal.
pub fn make_raw(fd: &impl AsRawFd) -> std::io::Result<()> {
    let fd = fd.as_raw_fd();
    // SAFETY: isatty only inspects the descriptor.
    if unsafe { libc::isatty(fd) } != 1 {
        return Ok(());
    }
    // SAFETY: termios is plain data; tcgetattr fills it completely on success,
    // which is checked before use.
    let mut termios: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: `termios` is a valid, writable termios struct.
    if unsafe { libc::tcgetattr(fd, &mut termios) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: cfmakeraw only modifies the struct it is given.
    unsafe { libc::cfmakeraw(&mut termios) };
    // SAFETY: `termios` is a valid termios struct obtained from tcgetattr.
    if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &termios) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Turns off echo on the terminal on `fd` (stdin) while it lives, so a secret typed
/// there does not appear on screen; restores the settings when dropped. Does nothing
/// when `fd` is not a terminal.
pub struct EchoOff {
    fd: i32,
    saved: Option<libc::termios>,
}

impl EchoOff {
    pub fn new(fd: &impl AsRawFd) -> EchoOff {
        let fd = fd.as_raw_fd();
        // SAFETY: termios is plain data, filled by tcgetattr (checked) before use.
        let mut termios: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: isatty inspects the descriptor; tcgetattr writes into a valid struct.
        let saved = (unsafe { libc::isatty(fd) } == 1
            && unsafe { libc::tcgetattr(fd, &mut termios) } == 0)
            .then_some(termios);
        if let Some(mut quiet) = saved {
            quiet.c_lflag &= !libc::ECHO;
            // SAFETY: `quiet` is a valid termios struct obtained from tcgetattr.
            unsafe { libc::tcsetattr(fd, libc::TCSANOW, &quiet) };
        }
        EchoOff { fd, saved }
    }
}

impl Drop for EchoOff {
    fn drop(&mut self) {
        if let Some(saved) = &self.saved {
            // SAFETY: `saved` is the terminal's own earlier state.
            unsafe { libc::tcsetattr(self.fd, libc::TCSANOW, saved) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_text_cannot_drive_the_terminal() {
        assert_eq!(printable("plain\n\ttext"), "plain\n\ttext");
        assert_eq!(
            printable("Kernel panic \u{1b}]0;owned\u{7}\r!"),
            "Kernel panic \\u{1b}]0;owned\\u{7}\\r!"
        );
        // A right-to-left override would show `curl x | sh` reversed.
        assert_eq!(
            printable("core.fsmonitor=\u{202e}hs | x lruc"),
            "core.fsmonitor=\\u{202e}hs | x lruc"
        );
        assert_eq!(one_line("a\u{2028}b\u{2066}c"), "a\\u{2028}b\\u{2066}c");
        assert_eq!(one_line("plain text"), "plain text");
        assert_eq!(
            one_line("gitdir: /x\r\u{1b}[2K\nvmctl: ok"),
            "gitdir: /x\\r\\u{1b}[2K\\nvmctl: ok"
        );
    }
}
