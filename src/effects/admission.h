/*-------------------------------------------------------------------------
 *
 * admission.h
 *	  Model admission: the limits of a model config (rpm, tpm,
 *	  concurrency) held in shared memory for every worker of a database.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_ADMISSION_H
#define TUVL_ADMISSION_H

#include "datatype/timestamp.h"
#include "nodes/pg_list.h"

/* What a model call with limits asks admission for (in the EffectRequest). */
typedef struct AdmitSpec
{
	char		config[NAMEDATALEN];	/* the model config's name */
	Oid			owner;			/* the config version's author */
	int			rpm;			/* 0: none */
	int			tpm;			/* 0: none */
	int			concurrency;	/* 0: none */
	int64		tokens;			/* estimated before sending */
	int			priority;		/* the run's */
	TimestampTz age;			/* the run's created_at: older first */
	Oid			principal;		/* the run's: fair across roles */
	int64		run_id;			/* for tuvl._model_admission_waits() */
	int			ticket;			/* -1: none yet */
} AdmitSpec;

/* Admission of a call: granted, or wait (until *retry_at, or a wake-up). */
typedef enum AdmitResult
{
	ADMIT_GRANTED,
	ADMIT_WAIT,
	ADMIT_UNLIMITED				/* no room in shared memory: sent unlimited */
} AdmitResult;

typedef struct AdmitMetric
{
	const char *name;
	const char *kind;			/* counter or gauge */
	char		config[NAMEDATALEN];
	Oid			owner;
	double		value;
} AdmitMetric;

extern Size AdmissionShmemSize(void);
extern void AdmissionShmemRequest(void);
extern void AdmissionShmemStartup(void);

extern int64 AdmissionEstimateTokens(size_t body_len);
extern AdmitResult AdmissionAsk(AdmitSpec *spec, TimestampTz *retry_at);
extern bool AdmissionSent(AdmitSpec *spec, TimestampTz *retry_at);
extern void AdmissionDone(AdmitSpec *spec, int64 actual_tokens, int status, int retry_after_ms);
extern void AdmissionWait(AdmitSpec *spec);
extern List *AdmissionMetrics(void);

/* A call waiting for admission now (AdmissionWaits). */
typedef struct AdmitWait
{
	int64		run_id;
	char		config[NAMEDATALEN];
	Oid			principal;
	TimestampTz since;
	const char *reason;			/* paused, concurrency or rate */
} AdmitWait;

extern List *AdmissionWaits(void);

#endif							/* TUVL_ADMISSION_H */
