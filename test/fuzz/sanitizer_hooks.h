/*-------------------------------------------------------------------------
 *
 * sanitizer_hooks.h
 *	  The comparison hooks the sanitizer's interceptors call: libFuzzer
 *	  defines them to learn the operands of memcmp, strcmp and the like.
 *	  fuzz.c hands libFuzzer's to asan_preload.c, which forwards to them.
 *
 * test/fuzz/sanitizer_hooks.h
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_SANITIZER_HOOKS_H
#define TUVL_SANITIZER_HOOKS_H

#include <stddef.h>

extern void __sanitizer_weak_hook_memcmp(void *pc, const void *s1, const void *s2,
										 size_t n, int result);
extern void __sanitizer_weak_hook_strncmp(void *pc, const char *s1, const char *s2,
										  size_t n, int result);
extern void __sanitizer_weak_hook_strncasecmp(void *pc, const char *s1, const char *s2,
											  size_t n, int result);
extern void __sanitizer_weak_hook_strcmp(void *pc, const char *s1, const char *s2,
										 int result);
extern void __sanitizer_weak_hook_strcasecmp(void *pc, const char *s1, const char *s2,
											 int result);
extern void __sanitizer_weak_hook_strstr(void *pc, const char *s1, const char *s2,
										 char *result);
extern void __sanitizer_weak_hook_strcasestr(void *pc, const char *s1, const char *s2,
											 char *result);
extern void __sanitizer_weak_hook_memmem(void *pc, const void *s1, size_t len1,
										 const void *s2, size_t len2, void *result);

#endif							/* TUVL_SANITIZER_HOOKS_H */
