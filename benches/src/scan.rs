//! Scanning VMM output: the guest's marker on the serial console (stdout), and
//! vmctl's boot-timer line (stderr).

/// Finds `needle` in a byte stream fed in arbitrary chunks (a match may straddle two
/// reads), without keeping the whole stream.
#[derive(Debug, Clone)]
pub struct MarkerScanner {
    needle: Vec<u8>,
    /// The last `needle.len() - 1` bytes seen, for matches across chunks.
    tail: Vec<u8>,
    found: bool,
}

impl MarkerScanner {
    pub fn new(needle: &str) -> Self {
        assert!(!needle.is_empty(), "empty marker");
        MarkerScanner {
            needle: needle.as_bytes().to_vec(),
            tail: Vec::new(),
            found: false,
        }
    }

    /// Feeds the next chunk; true once the marker has appeared (in this chunk or
    /// before).
    pub fn feed(&mut self, chunk: &[u8]) -> bool {
        if self.found {
            return true;
        }
        let mut window = std::mem::take(&mut self.tail);
        window.extend_from_slice(chunk);
        if window
            .windows(self.needle.len())
            .any(|w| w == self.needle.as_slice())
        {
            self.found = true;
            return true;
        }
        let keep = (self.needle.len() - 1).min(window.len());
        self.tail = window.split_off(window.len() - keep);
        false
    }

    pub fn found(&self) -> bool {
        self.found
    }
}

/// The VMM's boot-timer report on stderr:
/// `vmctl-vmm: boot time: <f> ms since VMM start, <f> ms since the first vCPU ran`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BootTimer {
    pub since_vmm_start_ms: f64,
    pub since_first_vcpu_ms: f64,
}

/// The first boot-timer line in `stderr`, if any.
pub fn parse_boot_timer(stderr: &str) -> Option<BootTimer> {
    stderr.lines().find_map(|line| {
        let rest = &line[line.find("boot time: ")? + "boot time: ".len()..];
        let (start, rest) = rest.split_once(" ms since VMM start, ")?;
        let (vcpu, _) = rest.split_once(" ms since the first vCPU ran")?;
        Some(BootTimer {
            since_vmm_start_ms: start.trim().parse().ok()?,
            since_first_vcpu_ms: vcpu.trim().parse().ok()?,
        })
    })
}

/// The last `max` characters of `text` (on a char boundary), for error reports.
pub fn tail(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut at = text.len() - max;
    while !text.is_char_boundary(at) {
        at += 1;
    }
    &text[at..]
}

/// What the guest kernel prints when it crashes, first line of its report.
const KERNEL_CRASH_SIGNS: [&str; 5] = [
    "BUG: ",
    "Oops: ",
    "general protection fault",
    "PANIC: double fault",
    "Kernel panic - not syncing",
];

/// The first line of a guest kernel crash report on its console, if there is one.
pub fn guest_kernel_crash(console: &str) -> Option<&str> {
    console
        .lines()
        .find(|line| KERNEL_CRASH_SIGNS.iter().any(|sign| line.contains(sign)))
        .map(str::trim)
}

/// Whether a console line carries the kernel's `[ seconds]` timestamp, as our guest
/// kernel's do (CONFIG_PRINTK_TIME). The nested host's kernel, which shares the
/// guest's console there, prints none (`printk.time=0`).
pub fn has_kernel_timestamp(line: &str) -> bool {
    line.find("] ").is_some_and(|end| {
        line[..end]
            .rfind('[')
            .is_some_and(|start| line[start + 1..end].trim().parse::<f64>().is_ok())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_timestamps_are_told_from_brackets() {
        assert!(has_kernel_timestamp(
            "[    1.6] BUG: unable to handle page fault"
        ));
        assert!(has_kernel_timestamp("agent output[   12.25] Oops: 0000"));
        assert!(!has_kernel_timestamp("BUG: unable to handle page fault"));
        assert!(!has_kernel_timestamp(
            "virtio_blk virtio1: [vda] 2097152 blocks"
        ));
    }

    #[test]
    fn marker_in_one_chunk() {
        let mut s = MarkerScanner::new("BENCH-INIT-REACHED");
        assert!(!s.feed(b"[    0.1] booting\r\n"));
        assert!(s.feed(b"BENCH-INIT-REACHED\r\n"));
        assert!(s.found());
        assert!(s.feed(b"anything"));
    }

    #[test]
    fn marker_straddling_chunks_byte_by_byte() {
        let stream = b"noise BENCH-INIT-REACHED\r\nmore";
        let mut s = MarkerScanner::new("BENCH-INIT-REACHED");
        let mut found_at = None;
        for (i, b) in stream.iter().enumerate() {
            if s.feed(std::slice::from_ref(b)) && found_at.is_none() {
                found_at = Some(i);
            }
        }
        assert_eq!(found_at, Some(6 + "BENCH-INIT-REACHED".len() - 1));
    }

    #[test]
    fn marker_split_in_two() {
        let mut s = MarkerScanner::new("BENCH-INIT-REACHED");
        assert!(!s.feed(b"xxBENCH-INI"));
        assert!(s.feed(b"T-REACHEDyy"));
    }

    #[test]
    fn near_misses_do_not_match() {
        let mut s = MarkerScanner::new("BENCH-INIT-REACHED");
        assert!(!s.feed(b"BENCH-INIT-REACHE"));
        assert!(!s.feed(b"X-not\r\nBENCH-INIT"));
        assert!(!s.feed(b"-REACHE\nD"));
        assert!(!s.found());
    }

    #[test]
    fn boot_timer_line() {
        let stderr = "vmctl: something\n\
                      vmctl-vmm: boot time: 5921.3 ms since VMM start, 4882.2 ms since the first vCPU ran\n";
        assert_eq!(
            parse_boot_timer(stderr),
            Some(BootTimer {
                since_vmm_start_ms: 5921.3,
                since_first_vcpu_ms: 4882.2
            })
        );
        assert_eq!(parse_boot_timer("vmctl: boot time: soon\n"), None);
        assert_eq!(parse_boot_timer(""), None);
    }

    #[test]
    fn tail_keeps_char_boundaries() {
        assert_eq!(tail("abc", 10), "abc");
        assert_eq!(tail("abcdef", 3), "def");
        assert_eq!(tail("aé", 1), "");
        assert_eq!(tail("aéb", 2), "b");
    }

    #[test]
    fn a_guest_kernel_crash_is_found_by_its_first_line() {
        let console = "[    1.2] virtio-mmio: probed\n\
                       [    1.6] BUG: unable to handle page fault for address: ffff88813bd1ac00\n\
                       [    1.6] #PF: supervisor read access in kernel mode\n\
                       [    1.7] Kernel panic - not syncing: Fatal exception\n";
        assert_eq!(
            guest_kernel_crash(console),
            Some("[    1.6] BUG: unable to handle page fault for address: ffff88813bd1ac00")
        );
        assert_eq!(
            guest_kernel_crash("[    0.9] Run /init as init process\nBENCH\n"),
            None
        );
    }
}
