//! VMM memory overhead from `/proc/<pid>/smaps`, the way Firecracker measures it: the
//! resident set of every mapping of the VMM process that is not guest memory.

use serde::{Deserialize, Serialize};

/// One mapping of `/proc/<pid>/smaps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub perms: String,
    /// Path or pseudo-name (`[heap]`, `/memfd:vmm-guest-ram (deleted)`); empty for an
    /// anonymous mapping.
    pub name: String,
    pub rss_kib: u64,
}

impl Mapping {
    pub fn size_bytes(&self) -> u64 {
        self.end - self.start
    }
}

/// Which mappings hold guest memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestMemoryRule {
    /// Mappings whose name contains this string. Our VMM backs guest memory with a
    /// memfd named `vmm-guest-ram`, so its mappings read `/memfd:vmm-guest-ram (deleted)`.
    NameContains(String),
    /// Anonymous mappings (no name) at least this many bytes long. QEMU allocates
    /// guest RAM with an anonymous mmap of exactly the RAM size; everything else it
    /// maps anonymously (thread stacks of 8 MiB, malloc arenas of 64 MiB) is smaller
    /// than a 128 MiB guest. The rule would misfire for guests of 64 MiB or less.
    AnonymousAtLeast(u64),
}

impl GuestMemoryRule {
    pub fn is_guest(&self, m: &Mapping) -> bool {
        match self {
            GuestMemoryRule::NameContains(s) => m.name.contains(s.as_str()),
            GuestMemoryRule::AnonymousAtLeast(bytes) => {
                m.name.is_empty() && m.size_bytes() >= *bytes
            }
        }
    }

    pub fn describe(&self) -> String {
        match self {
            GuestMemoryRule::NameContains(s) => format!("mappings named *{s}*"),
            GuestMemoryRule::AnonymousAtLeast(b) => {
                format!(
                    "anonymous mappings of at least {} MiB (the guest memory size)",
                    b >> 20
                )
            }
        }
    }
}

/// Memory of a VMM process, split into guest memory and the VMM's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryUse {
    /// Rss summed over every mapping.
    pub total_rss_kib: u64,
    /// Rss of the guest-memory mappings.
    pub guest_rss_kib: u64,
    /// Rss of everything else: the VMM's overhead.
    pub overhead_rss_kib: u64,
    /// How many mappings were counted as guest memory, and their total size.
    pub guest_mappings: usize,
    pub guest_mapped_kib: u64,
}

/// Parses the text of `/proc/<pid>/smaps`. Returns an error on a line it cannot
/// place (a field before any mapping header, an unparsable Rss).
pub fn parse_smaps(text: &str) -> Result<Vec<Mapping>, String> {
    let mut maps: Vec<Mapping> = Vec::new();
    for (no, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if let Some(mapping) = parse_header(line) {
            maps.push(mapping);
            continue;
        }
        let Some((key, value)) = line.split_once(':') else {
            return Err(format!("smaps line {}: unexpected {line:?}", no + 1));
        };
        if key == "Rss" {
            let current = maps
                .last_mut()
                .ok_or_else(|| format!("smaps line {}: Rss before any mapping", no + 1))?;
            let kib = value
                .trim()
                .strip_suffix("kB")
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| format!("smaps line {}: bad Rss {value:?}", no + 1))?;
            current.rss_kib = kib;
        }
    }
    Ok(maps)
}

/// `start-end perms offset dev inode [name]`; `None` if `line` is not a header.
fn parse_header(line: &str) -> Option<Mapping> {
    let mut rest = line;
    let mut fields = Vec::with_capacity(5);
    for _ in 0..5 {
        rest = rest.trim_start();
        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        if end == 0 {
            return None;
        }
        fields.push(&rest[..end]);
        rest = &rest[end..];
    }
    let (start, end) = fields[0].split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    if end < start || fields[1].len() != 4 {
        return None;
    }
    Some(Mapping {
        start,
        end,
        perms: fields[1].to_string(),
        name: rest.trim().to_string(),
        rss_kib: 0,
    })
}

/// Splits the Rss of `maps` into guest memory (by `rule`) and overhead.
pub fn account(maps: &[Mapping], rule: &GuestMemoryRule) -> MemoryUse {
    let mut use_ = MemoryUse {
        total_rss_kib: 0,
        guest_rss_kib: 0,
        overhead_rss_kib: 0,
        guest_mappings: 0,
        guest_mapped_kib: 0,
    };
    for m in maps {
        use_.total_rss_kib += m.rss_kib;
        if rule.is_guest(m) {
            use_.guest_rss_kib += m.rss_kib;
            use_.guest_mappings += 1;
            use_.guest_mapped_kib += m.size_bytes() >> 10;
        } else {
            use_.overhead_rss_kib += m.rss_kib;
        }
    }
    use_
}

#[cfg(test)]
mod tests {
    use super::*;

    const OURS: &str = "\
55d0c0a00000-55d0c0a4b000 r--p 00000000 00:1f 1234                       /work/main/target/release/vmctl
Size:                300 kB
KernelPageSize:        4 kB
Rss:                 280 kB
Pss:                 280 kB
VmFlags: rd mr mw me dw sd
55d0c2000000-55d0c2021000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
Rss:                  40 kB
VmFlags: rd wr mr mw me ac sd
7f1200000000-7f1208000000 rw-s 00000000 00:01 5678                       /memfd:vmm-guest-ram (deleted)
Size:             131072 kB
Rss:               20480 kB
THPeligible:    0
VmFlags: rd wr sh mr mw me ms sd
7f1208000000-7f1208800000 rw-p 00000000 00:00 0 
Size:               8192 kB
Rss:                  16 kB
ProtectionKey:         0
VmFlags: rd wr mr mw me ac sd
";

    #[test]
    fn parses_headers_names_and_rss() {
        let maps = parse_smaps(OURS).unwrap();
        assert_eq!(maps.len(), 4);
        assert_eq!(maps[0].name, "/work/main/target/release/vmctl");
        assert_eq!(maps[0].perms, "r--p");
        assert_eq!(maps[0].rss_kib, 280);
        assert_eq!(maps[1].name, "[heap]");
        assert_eq!(maps[2].name, "/memfd:vmm-guest-ram (deleted)");
        assert_eq!(maps[2].size_bytes(), 128 << 20);
        assert_eq!(maps[2].rss_kib, 20480);
        assert_eq!(maps[3].name, "");
        assert_eq!(maps[3].rss_kib, 16);
    }

    #[test]
    fn ours_excludes_the_memfd() {
        let maps = parse_smaps(OURS).unwrap();
        let u = account(
            &maps,
            &GuestMemoryRule::NameContains("memfd:vmm-guest-ram".into()),
        );
        assert_eq!(u.total_rss_kib, 280 + 40 + 20480 + 16);
        assert_eq!(u.guest_rss_kib, 20480);
        assert_eq!(u.overhead_rss_kib, 280 + 40 + 16);
        assert_eq!(u.guest_mappings, 1);
        assert_eq!(u.guest_mapped_kib, 128 << 10);
    }

    #[test]
    fn qemu_rule_takes_only_big_anonymous_mappings() {
        let qemu = "\
7f0000000000-7f0008000000 rw-p 00000000 00:00 0 
Rss:               30000 kB
7f0008000000-7f000c000000 rw-p 00000000 00:00 0 
Rss:                 500 kB
7f000c000000-7f0014000000 rw-s 00000000 00:01 9                          /some/file
Rss:                 100 kB
";
        let maps = parse_smaps(qemu).unwrap();
        let u = account(&maps, &GuestMemoryRule::AnonymousAtLeast(128 << 20));
        assert_eq!(u.guest_mappings, 1);
        assert_eq!(u.guest_rss_kib, 30000);
        // The 64 MiB anonymous region and the 128 MiB named file are overhead.
        assert_eq!(u.overhead_rss_kib, 600);
        assert_eq!(u.total_rss_kib, 30600);
    }

    #[test]
    fn rejects_garbage() {
        assert!(parse_smaps("Rss: 4 kB\n").is_err());
        assert!(parse_smaps("hello\n").is_err());
        assert!(parse_smaps("7f00-7f01 rw-p 0 00:00 0\nRss: four kB\n").is_err());
        assert_eq!(parse_smaps("").unwrap(), vec![]);
    }
}
