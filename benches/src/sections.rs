//! The benchmark's sections and `--only`, which picks some of them: a section that
//! failed, or the one a change touched, can be measured again without a whole run.

use serde::{Deserialize, Serialize};

/// A part of the benchmark, in the order a run measures them; named in reports as on
/// the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Section {
    /// Boot time and memory against QEMU microvm, and the cold `vmctl exec` end points.
    Boot,
    /// Create/destroy cycles against QEMU microvm.
    Churn,
    /// `vmctl up` and exec round trips.
    Workspace,
    /// The shared workspace directory (virtio-fs) against the host.
    Fs,
    /// Requests through the egress proxy against the host's direct ones.
    Egress,
    /// `vmctl agent claude --version`, cold and warm, and idle VMs' memory.
    Agent,
}

impl Section {
    pub const ALL: [Section; 6] = [
        Section::Boot,
        Section::Churn,
        Section::Workspace,
        Section::Fs,
        Section::Egress,
        Section::Agent,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Section::Boot => "boot",
            Section::Churn => "churn",
            Section::Workspace => "workspace",
            Section::Fs => "fs",
            Section::Egress => "egress",
            Section::Agent => "agent",
        }
    }

    fn from_name(name: &str) -> Option<Section> {
        Section::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// The names of all sections, for messages.
pub fn all_names() -> String {
    join(&Section::ALL, ", ")
}

/// Adds the sections a `--only` value names (comma-separated) to `chosen`, keeping
/// them in run order without repeats.
pub fn add_named(chosen: &mut Vec<Section>, list: &str) -> Result<(), String> {
    for name in list.split(',').map(str::trim) {
        let section = Section::from_name(name).ok_or_else(|| {
            format!(
                "--only: no section {name:?}; the sections are {}",
                all_names()
            )
        })?;
        if !chosen.contains(&section) {
            chosen.push(section);
        }
    }
    chosen.sort();
    Ok(())
}

/// The `--only` value that selects `sections` (for the run inside the nested host).
pub fn to_arg(sections: &[Section]) -> String {
    join(sections, ",")
}

/// The sections' names, `separator` between them.
pub fn join(sections: &[Section], separator: &str) -> String {
    sections
        .iter()
        .map(|s| s.name())
        .collect::<Vec<_>>()
        .join(separator)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_added_in_run_order_once() {
        let mut chosen = Vec::new();
        add_named(&mut chosen, "fs,boot").unwrap();
        add_named(&mut chosen, "egress, fs").unwrap();
        assert_eq!(chosen, [Section::Boot, Section::Fs, Section::Egress]);
        assert_eq!(to_arg(&chosen), "boot,fs,egress");
    }

    #[test]
    fn an_unknown_name_lists_the_sections() {
        let error = add_named(&mut Vec::new(), "fs,disk").unwrap_err();
        assert!(error.contains("\"disk\""), "{error}");
        assert!(
            error.contains("boot, churn, workspace, fs, egress, agent"),
            "{error}"
        );
        assert!(add_named(&mut Vec::new(), "").is_err());
    }

    #[test]
    fn every_section_round_trips_through_its_name() {
        let mut chosen = Vec::new();
        add_named(&mut chosen, &to_arg(&Section::ALL)).unwrap();
        assert_eq!(chosen, Section::ALL);
        // Reports name them as the command line does.
        for section in Section::ALL {
            assert_eq!(
                serde_json::to_value(section).unwrap(),
                serde_json::json!(section.name())
            );
        }
    }
}
