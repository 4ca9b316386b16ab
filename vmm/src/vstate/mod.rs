//! KVM state: the VM file descriptor with its memory slots and in-kernel irqchip
//! ([`vm`]), the vCPUs and their run loops ([`vcpu`]), and how a run ends ([`exit`]).

pub mod exit;
pub mod vcpu;
pub mod vm;
