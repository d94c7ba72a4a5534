/*-------------------------------------------------------------------------
 *
 * asan_preload.c
 *	  Preloaded after clang's AddressSanitizer runtime into a postgres that
 *	  is not built with it (run.sh): lets the runtime start, and passes its
 *	  comparison hooks on to libFuzzer.
 *
 * Debian's postgres links libgpg-error (through libsystemd, libldap and
 * gnutls), whose constructor calls bindtextdomain().  That holds glibc's
 * gettext lock while it mallocs, and the first malloc starts the runtime,
 * which looks up swift_demangle with dlsym() and, not finding it, calls
 * dlerror(), which translates its message under the same lock: the lock
 * is corrupted and the next bindtextdomain() waits forever.  Defining the
 * symbol makes the lookup succeed.  The runtime calls it to demangle Swift
 * names; NULL says "not a Swift name".
 *
 * The runtime's interceptors of memcmp, strcmp and the like call weak hooks
 * that libFuzzer defines to learn the strings an input is compared with.
 * The runtime binds them when it loads, long before the fuzzing build of
 * tuvl.so (which holds libFuzzer) is loaded, so it would find none.  This
 * library defines them and forwards each call to the functions the
 * harness registers with tuvl_fuzz_set_hooks() when it starts (fuzz.c).
 *
 * test/fuzz/asan_preload.c
 *
 *-------------------------------------------------------------------------
 */
#include <stddef.h>
#include <stdint.h>

#include "sanitizer_hooks.h"

typedef void (*CmpHook) (void *pc, const void *s1, const void *s2, size_t n, int result);
typedef void (*StrHook) (void *pc, const char *s1, const char *s2, int result);
typedef void (*FindHook) (void *pc, const char *s1, const char *s2, char *result);
typedef void (*MemmemHook) (void *pc, const void *s1, size_t len1, const void *s2,
							size_t len2, void *result);

/* The hooks, in the order tuvl_fuzz_set_hooks takes them. */
enum
{
	HOOK_MEMCMP,
	HOOK_STRNCMP,
	HOOK_STRNCASECMP,
	HOOK_STRCMP,
	HOOK_STRCASECMP,
	HOOK_STRSTR,
	HOOK_STRCASESTR,
	HOOK_MEMMEM,
	NHOOKS
};

static void *hooks[NHOOKS];

extern char *swift_demangle(const char *mangled, size_t len, char *out,
							size_t *outlen, uint32_t flags);
extern void tuvl_fuzz_set_hooks(void *const *fns, int n);

char *
swift_demangle(const char *mangled, size_t len, char *out, size_t *outlen,
			   uint32_t flags)
{
	return NULL;
}

/* Called by the harness with libFuzzer's hooks; NULLs turn them off. */
void
tuvl_fuzz_set_hooks(void *const *fns, int n)
{
	for (int i = 0; i < n && i < NHOOKS; i++)
		hooks[i] = fns[i];
}

void
__sanitizer_weak_hook_memcmp(void *pc, const void *s1, const void *s2, size_t n, int result)
{
	if (hooks[HOOK_MEMCMP])
		((CmpHook) hooks[HOOK_MEMCMP]) (pc, s1, s2, n, result);
}

void
__sanitizer_weak_hook_strncmp(void *pc, const char *s1, const char *s2, size_t n, int result)
{
	if (hooks[HOOK_STRNCMP])
		((CmpHook) hooks[HOOK_STRNCMP]) (pc, s1, s2, n, result);
}

void
__sanitizer_weak_hook_strncasecmp(void *pc, const char *s1, const char *s2, size_t n,
								  int result)
{
	if (hooks[HOOK_STRNCASECMP])
		((CmpHook) hooks[HOOK_STRNCASECMP]) (pc, s1, s2, n, result);
}

void
__sanitizer_weak_hook_strcmp(void *pc, const char *s1, const char *s2, int result)
{
	if (hooks[HOOK_STRCMP])
		((StrHook) hooks[HOOK_STRCMP]) (pc, s1, s2, result);
}

void
__sanitizer_weak_hook_strcasecmp(void *pc, const char *s1, const char *s2, int result)
{
	if (hooks[HOOK_STRCASECMP])
		((StrHook) hooks[HOOK_STRCASECMP]) (pc, s1, s2, result);
}

void
__sanitizer_weak_hook_strstr(void *pc, const char *s1, const char *s2, char *result)
{
	if (hooks[HOOK_STRSTR])
		((FindHook) hooks[HOOK_STRSTR]) (pc, s1, s2, result);
}

void
__sanitizer_weak_hook_strcasestr(void *pc, const char *s1, const char *s2, char *result)
{
	if (hooks[HOOK_STRCASESTR])
		((FindHook) hooks[HOOK_STRCASESTR]) (pc, s1, s2, result);
}

void
__sanitizer_weak_hook_memmem(void *pc, const void *s1, size_t len1, const void *s2,
							 size_t len2, void *result)
{
	if (hooks[HOOK_MEMMEM])
		((MemmemHook) hooks[HOOK_MEMMEM]) (pc, s1, len1, s2, len2, result);
}
