//! Which host CPUs a VM runs on: [`VCPU_CPUS_ENV`], a list such as `1-2` or `1,3`, as
//! `taskset -c` takes it (unset or empty: any CPU, the scheduler's choice).
//!
//! `vmctl-vmm`'s main thread takes the set just before it starts the vCPU threads,
//! which inherit it, as do the device workers they start when the guest's drivers are
//! ready: from then on the whole VMM runs there (the main thread serves the block, rng
//! and console devices). Where the VM runs in a nested host, the same host CPUs hold the
//! whole nested host ([`CpuSet::apply_to_command`]), and inside it the guest keeps off
//! the nested host's CPU 0 (docs/nested-host.md). The benchmark gives QEMU's microvm
//! the set our VMM has, so that both run alike.

use std::io;
use std::os::unix::process::CommandExt;
use std::process::Command;

use super::VCPU_CPUS_ENV;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CpusError {
    #[error(
        "{VCPU_CPUS_ENV}={0:?} is not a list of CPUs: give numbers and ranges such as \
         1-2 or 1,3, as taskset -c takes them, or leave it unset"
    )]
    NotAList(String),
    #[error(
        "{VCPU_CPUS_ENV}={list:?} names CPU {cpu}, beyond the {max} a process can be pinned to"
    )]
    TooHigh {
        list: String,
        cpu: usize,
        max: usize,
    },
    #[error(
        "{VCPU_CPUS_ENV}={list:?} names CPU(s) {missing} that this process cannot run on \
         (it may use {allowed}): name only those, or leave it unset"
    )]
    Unavailable {
        list: String,
        missing: String,
        allowed: String,
    },
    #[error("cannot run the VM on CPUs {list:?} ({VCPU_CPUS_ENV}): {reason}")]
    Pin { list: String, reason: String },
}

/// A set of host CPUs, read from a `taskset -c` list.
#[derive(Clone)]
pub struct CpuSet {
    cpus: Vec<usize>,
    list: String,
    set: libc::cpu_set_t,
}

impl std::fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CpuSet").field(&self.cpus).finish()
    }
}

impl PartialEq for CpuSet {
    fn eq(&self, other: &Self) -> bool {
        self.cpus == other.cpus
    }
}

impl CpuSet {
    /// The set `VMCTL_VCPU_CPUS` names; `None` when it is unset or empty. Every CPU
    /// in it must be one this process may run on (the kernel would otherwise take
    /// the rest of the set without a word, or refuse it with a bare EINVAL).
    pub fn from_env() -> Result<Option<Self>, CpusError> {
        match std::env::var(VCPU_CPUS_ENV) {
            Ok(list) if !list.trim().is_empty() => {
                let set = Self::parse(&list)?;
                let allowed = allowed_cpus().map_err(|e| CpusError::Pin {
                    list: set.list.clone(),
                    reason: format!("cannot read the CPUs this process may use: {e}"),
                })?;
                set.within(&allowed).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The set, if every CPU of it is in `allowed`.
    fn within(self, allowed: &[usize]) -> Result<Self, CpusError> {
        let missing: Vec<usize> = self
            .cpus
            .iter()
            .copied()
            .filter(|cpu| !allowed.contains(cpu))
            .collect();
        if missing.is_empty() {
            return Ok(self);
        }
        Err(CpusError::Unavailable {
            list: self.list,
            missing: as_list(&missing),
            allowed: as_list(allowed),
        })
    }

    /// Parses a CPU list: comma-separated numbers and `first-last` ranges.
    pub fn parse(list: &str) -> Result<Self, CpusError> {
        let not_a_list = || CpusError::NotAList(list.to_string());
        let number = |text: &str| text.trim().parse::<usize>().map_err(|_| not_a_list());
        let max = libc::CPU_SETSIZE as usize;
        let mut cpus = Vec::new();
        for item in list.split(',') {
            let (first, last) = match item.split_once('-') {
                Some((first, last)) => (number(first)?, number(last)?),
                None => (number(item)?, number(item)?),
            };
            if first > last {
                return Err(not_a_list());
            }
            if last >= max {
                return Err(CpusError::TooHigh {
                    list: list.to_string(),
                    cpu: last,
                    max,
                });
            }
            cpus.extend(first..=last);
        }
        cpus.sort_unstable();
        cpus.dedup();
        // SAFETY: an all-zero cpu_set_t is the empty set, a valid value of this plain
        // bitmask struct.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &cpu in &cpus {
            // SAFETY: every CPU was checked above to be below CPU_SETSIZE, the set's
            // capacity.
            unsafe { libc::CPU_SET(cpu, &mut set) };
        }
        Ok(Self {
            cpus,
            list: list.trim().to_string(),
            set,
        })
    }

    /// The CPUs, in order.
    pub fn cpus(&self) -> &[usize] {
        &self.cpus
    }

    /// The list as it was given.
    pub fn list(&self) -> &str {
        &self.list
    }

    /// Restricts the calling thread (and the threads it starts from now on) to the set.
    pub fn pin_this_thread(&self) -> Result<(), CpusError> {
        self.pin_calling_thread().map_err(|e| CpusError::Pin {
            list: self.list.clone(),
            reason: e.to_string(),
        })
    }

    /// Runs `command`'s process, every thread of it, on the set.
    pub fn apply_to_command(&self, command: &mut Command) {
        let set = self.clone();
        // SAFETY: the closure runs in the child between fork and exec; it only calls
        // sched_setaffinity(2), which is async-signal-safe, on a set built before the
        // fork, and allocates nothing unless the call fails.
        unsafe {
            command.pre_exec(move || set.pin_calling_thread());
        }
    }

    fn pin_calling_thread(&self) -> io::Result<()> {
        // SAFETY: `set` is a valid cpu_set_t that outlives the call, and its size is
        // the one passed; pid 0 names the calling thread.
        let result =
            unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&self.set), &self.set) };
        if result != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// `cpus` (in order) as `taskset -c` takes them: runs of CPUs as ranges.
fn as_list(cpus: &[usize]) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &cpu in cpus {
        match runs.last_mut() {
            Some((_, last)) if *last + 1 == cpu => *last = cpu,
            _ => runs.push((cpu, cpu)),
        }
    }
    runs.iter()
        .map(|&(first, last)| match last - first {
            0 => first.to_string(),
            1 => format!("{first},{last}"),
            _ => format!("{first}-{last}"),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The CPUs the calling thread may run on.
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: as in `CpuSet::parse`, an all-zero cpu_set_t is valid.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is valid and writable for its size; pid 0 is this thread.
    let result = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    if result != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: every index is below the set's capacity.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpus(list: &str) -> Result<Vec<usize>, CpusError> {
        CpuSet::parse(list).map(|set| set.cpus().to_vec())
    }

    #[test]
    fn lists_are_read_as_taskset_reads_them() {
        assert_eq!(cpus("1-2"), Ok(vec![1, 2]));
        assert_eq!(cpus("3,1, 2-3"), Ok(vec![1, 2, 3]));
        assert_eq!(cpus("0"), Ok(vec![0]));
        for bad in ["", "x", "2-1", "1-", "-1", "1,,2", "1.5"] {
            assert_eq!(cpus(bad), Err(CpusError::NotAList(bad.into())), "{bad:?}");
        }
        let error = cpus("0-100000").unwrap_err().to_string();
        assert!(error.contains("CPU 100000"), "{error}");
    }

    #[test]
    fn a_set_beyond_the_cpus_this_process_may_use_is_refused_by_name() {
        assert_eq!(as_list(&[0, 1, 2, 3, 5, 7, 8]), "0-3,5,7,8");
        assert_eq!(as_list(&[]), "");
        let set = || CpuSet::parse("1-3").unwrap();
        assert_eq!(set().within(&[0, 1, 2, 3]), Ok(set()));
        let error = set().within(&[0, 1]).unwrap_err();
        assert_eq!(
            error,
            CpusError::Unavailable {
                list: "1-3".into(),
                missing: "2,3".into(),
                allowed: "0,1".into(),
            }
        );
        assert!(error.to_string().contains("names CPU(s) 2,3"), "{error}");
    }

    fn this_cpu() -> usize {
        // SAFETY: sched_getcpu takes no arguments.
        let cpu = unsafe { libc::sched_getcpu() };
        usize::try_from(cpu).expect("sched_getcpu")
    }

    #[test]
    fn a_thread_pinned_to_a_cpu_runs_there_and_its_children_inherit_it() {
        // A thread of its own, so the test harness's threads keep every CPU.
        std::thread::spawn(|| {
            let cpu = this_cpu();
            CpuSet::parse(&cpu.to_string())
                .unwrap()
                .pin_this_thread()
                .unwrap();
            let allowed = std::thread::spawn(allowed_cpus).join().unwrap().unwrap();
            assert_eq!(allowed, vec![cpu], "a thread started after the pin");
        })
        .join()
        .unwrap();
        let beyond = (libc::CPU_SETSIZE - 1).to_string();
        assert!(
            CpuSet::parse(&beyond).unwrap().pin_this_thread().is_err(),
            "a CPU this machine does not have is refused"
        );
    }

    #[test]
    fn a_command_runs_on_the_set_and_a_set_it_cannot_have_fails_its_start() {
        let cpu = this_cpu();
        let mut command = Command::new("grep");
        command.args(["^Cpus_allowed_list:", "/proc/self/status"]);
        CpuSet::parse(&cpu.to_string())
            .unwrap()
            .apply_to_command(&mut command);
        let output = command.output().expect("run grep");
        let line = String::from_utf8_lossy(&output.stdout);
        assert_eq!(line.trim(), format!("Cpus_allowed_list:\t{cpu}"));

        let mut command = Command::new("true");
        let beyond = (libc::CPU_SETSIZE - 1).to_string();
        CpuSet::parse(&beyond)
            .unwrap()
            .apply_to_command(&mut command);
        assert!(
            command.status().is_err(),
            "the spawn reports the failed pin"
        );
    }
}
