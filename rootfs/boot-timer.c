/*
 * boot-timer: tells the VMM that the guest's userspace has started.
 *
 * Writes the magic value 123 to I/O port 0x3f0, the VMM's boot timer (the same
 * scheme as Firecracker's historical x86 boot timer). With `vmctl boot --boot-time`
 * the VMM then prints how long the boot took. Run by /init as early as possible.
 *
 * Built by rootfs/build-initramfs.sh with `gcc -static -Os -s`.
 */
#include <stdio.h>
#include <sys/io.h>

#define BOOT_TIMER_PORT 0x3f0
#define BOOT_TIMER_MAGIC 123

int main(void)
{
    if (ioperm(BOOT_TIMER_PORT, 1, 1) != 0) {
        perror("boot-timer: ioperm(0x3f0)");
        return 1;
    }
    outb(BOOT_TIMER_MAGIC, BOOT_TIMER_PORT);
    return 0;
}
