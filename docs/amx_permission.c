/* Does AMX work in this VM? One bf16 tile product, with and without asking Linux for the tile
 * state first. Since Linux 5.16 a process must request XTILEDATA with arch_prctl before its first
 * AMX instruction; without the request the instruction raises SIGILL (exit status 132).
 *
 *   gcc -O2 -mamx-tile -mamx-bf16 docs/amx_permission.c -o /tmp/amx
 *   /tmp/amx          # no request: "Illegal instruction", status 132
 *   /tmp/amx request  # request granted (0), then the product: 32.0
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed));

int main(int argc, char **argv) {
    if (argc > 1)
        printf("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) = %ld\n",
               syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA));
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 3; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    _tile_loadconfig(&cfg);
    static uint16_t a[16 * 32], b[16 * 32];
    static float c[16 * 16];
    for (int i = 0; i < 16 * 32; i++) a[i] = b[i] = 0x3f80; /* bf16 1.0 */
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbf16ps(0, 1, 2); /* c = sum over 32 products of 1.0 * 1.0 */
    _tile_stored(0, c, 64);
    _tile_release();
    printf("c[0] = %.1f (expect 32.0)\n", c[0]);
    return 0;
}
