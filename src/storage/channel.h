/*-------------------------------------------------------------------------
 *
 * channel.h
 *	  The NOTIFY channels of the journal: one per role, and the operators'.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_CHANNEL_H
#define TUVL_CHANNEL_H

extern void ChannelInit(void);
extern const char *ChannelOfRole(Oid role);
extern const char *ChannelOfOperators(void);

#endif							/* TUVL_CHANNEL_H */
