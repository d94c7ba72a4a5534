/*-------------------------------------------------------------------------
 *
 * workflow.h
 *	  The in-memory model of a registered workflow version.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_WORKFLOW_H
#define TUVL_WORKFLOW_H

#include "nodes/pg_list.h"
#include "utils/jsonb.h"

#include "duration.h"
#include "nameindex.h"

typedef enum StepKind
{
	STEP_FUNCTIONAL,
	STEP_MODELOP,
	STEP_ROUTER,
	STEP_APICALL,
	STEP_MCP,
	STEP_AGENT,
	STEP_HUMAN,
	STEP_SLEEP,
	STEP_WORKFLOW,
	STEP_KIND_COUNT
} StepKind;

typedef struct StepDef
{
	char	   *id;
	StepKind	kind;
	const char *kind_name;
	Jsonb	   *spec;			/* the step's whole YAML object */
	char	   *output_key;		/* context key the result is written to */
	Jsonb	   *routes;			/* signal -> target, or NULL */
	int			next;			/* implicit default: index of the next
								 * main-line step, or -1 (implicit end) */
	int			timeout_ms;		/* timeout:, or -1 for tuvl.step_timeout */
	List	   *hooks;			/* hook references (char *): the workflow's,
								 * then the step's */
} StepDef;

typedef struct EndDef
{
	char	   *id;
	char	   *status;			/* completed | failed */
	Jsonb	   *response;		/* template, or NULL */
	bool		rollback;
} EndDef;

typedef struct WorkflowDef
{
	char	   *name;
	int			version;
	Jsonb	   *definition;
	Jsonb	   *input_schema;	/* trigger.input, or NULL */
	int			sync_timeout_ms;	/* trigger.sync_timeout, or -1 */
	int			nsteps;
	StepDef    *steps;
	int			nends;
	EndDef	   *ends;
	int			start;			/* index of the first step */
	NameIndex  *step_index;		/* step id -> index in steps */
	Oid			owner;			/* the role the version belongs to */
	Jsonb	   *refs;			/* the owners of what it names, pinned at
								 * registration (uses.c); NULL: registered
								 * before 0.3.0 */
} WorkflowDef;

extern const char *const WorkflowKindNames[STEP_KIND_COUNT];

extern bool WorkflowKindFromName(const char *name, StepKind *kind);
extern WorkflowDef *WorkflowCompile(const char *name, int version, Jsonb *definition);
extern WorkflowDef *WorkflowLoad(const char *name, int version);
extern int	WorkflowLatestVersion(const char *name, bool missing_ok);
extern int	WorkflowFindStep(WorkflowDef *wf, const char *id);
struct UseReferrer;
extern void WorkflowReferrer(WorkflowDef *wf, struct UseReferrer *by);
extern EndDef *WorkflowFindEnd(WorkflowDef *wf, const char *id);

#endif							/* TUVL_WORKFLOW_H */
