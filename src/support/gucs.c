/*-------------------------------------------------------------------------
 *
 * gucs.c
 *	  The library's GUCs, their bounds and checks, and the size limits
 *	  messages quote.
 *
 * Every GUC of tuvl is defined here (GucsDefine, called from
 * _PG_init) and declared in tuvl.h; a postmaster-level one is defined
 * only while preloading.  The prefix tuvl is reserved once all are
 * defined, so a misspelt tuvl.* setting is reported.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"
#include "utils/varlena.h"

#include "tuvl.h"

int			tuvl_workers_per_database = 2;
int			tuvl_max_workers = 16;
int			tuvl_max_model_limits = 64;
int			tuvl_model_admission_slots = 16384;
int			tuvl_model_limits_window = 60000;
int			tuvl_lease_timeout = 30000;
int			tuvl_heartbeat_interval = 5000;
int			tuvl_runs_per_worker = 512;
int			tuvl_launcher_naptime = 10000;
int			tuvl_sync_timeout = 30000;
int			tuvl_max_recoveries = 3;
char	   *tuvl_http_allowed_hosts = NULL;
int			tuvl_http_timeout = 30000;
int			tuvl_agent_tool_timeout = 300;
int			tuvl_agent_pause_max = 300;
int			tuvl_step_timeout = 10 * 60 * 1000;
int			tuvl_max_step_timeout = 60 * 60 * 1000;
int			tuvl_max_child_depth = 8;
int			tuvl_max_run_tree = 10000;
int			tuvl_metric_series_per_role = 2048;
int			tuvl_max_batch_time = 50;
int			tuvl_max_input_size = 8 * 1024 * 1024;
int			tuvl_max_output_size = 16 * 1024 * 1024;
int			tuvl_max_source_size = 1024 * 1024;
int			tuvl_max_worker_memory = 256 * 1024;	/* kB */
int			tuvl_http_max_response_size = 10 * 1024 * 1024;
int			tuvl_http_max_redirects = 5;
bool		tuvl_http_verify_tls = true;
char	   *tuvl_http_ca_file = NULL;
char	   *tuvl_oauth_redirect_uri = NULL;
bool		tuvl_http2 = true;
bool		tuvl_log_agent_events = false;
char	   *tuvl_otlp_endpoint = NULL;
char	   *tuvl_retention = NULL;
char	   *tuvl_databases = NULL;
static int	tuvl_partition = -1;	/* read in SQL: tuvl._next_run_id() */

/* "50 MB", "512 kB" or "300 bytes", for messages about sizes. */
char *
GucsSizeText(int64 bytes)
{
	if (bytes >= 1024 * 1024)
		return bytes % (1024 * 1024) == 0 ? psprintf(INT64_FORMAT " MB", bytes / (1024 * 1024))
			: psprintf("%.1f MB", bytes / (1024.0 * 1024.0));
	if (bytes >= 1024)
		return bytes % 1024 == 0 ? psprintf(INT64_FORMAT " kB", bytes / 1024)
			: psprintf("%.1f kB", bytes / 1024.0);
	return psprintf(INT64_FORMAT " bytes", bytes);
}

/*
 * Raise when what (e.g. "the run input") of size bytes passes the limit
 * set by the GUC named guc.
 */
void
GucsCheckSize(const char *what, int64 bytes, int64 limit, const char *guc)
{
	if (bytes > limit)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("%s is %s, more than %s (%s)", what, GucsSizeText(bytes), guc,
						GucsSizeText(limit)),
				 errhint("A superuser can raise %s.", guc)));
}

/* An integer GUC of the library; see define_int_gucs. */
typedef struct IntGuc
{
	const char *name;
	const char *short_desc;
	const char *long_desc;		/* NULL: none */
	int		   *variable;
	int			boot;
	int			min;
	int			max;
	GucContext	context;
	int			flags;
	bool		preload_only;	/* postmaster-level: defined only while
								 * preloading */
} IntGuc;

/* Workers, leases and tuvl.run(), in the order they are defined. */
static const IntGuc worker_gucs[] = {
	{"tuvl.workers_per_database",
		"Background workers executing runs in each database with the extension.",
		"Changes take effect on reload: the launcher starts or stops workers.",
	&tuvl_workers_per_database, 2, 0, 64, PGC_SIGHUP, 0, false},
	{"tuvl.max_workers",
		"Maximum number of tuvl workers across all databases.",
		"Each also needs a slot of max_worker_processes.",
	&tuvl_max_workers, 16, 1, 1024, PGC_POSTMASTER, 0, true},
	{"tuvl.max_model_limits",
		"Maximum number of model configs with limits: tracked in shared memory.",
		"A config past it is sent without its limits, counted in tuvl.llm.admission.unlimited.",
	&tuvl_max_model_limits, 64, 1, 100000, PGC_POSTMASTER, 0, true},
	{"tuvl.model_admission_slots",
		"Maximum number of model calls with limits waiting or in flight at once, cluster-wide.",
		"A call finding none free waits and asks again 100 ms later.",
	&tuvl_model_admission_slots, 16384, 16, 1000000, PGC_POSTMASTER, 0, true},
	{"tuvl.model_limits_window",
		"The window over which a model config's limits (rpm, tpm) hold.",
		"Providers measure a minute; a shorter window scales the limits down with it.",
	&tuvl_model_limits_window, 60000, 1000, 3600000, PGC_SIGHUP, GUC_UNIT_MS, false},
	{"tuvl.lease_timeout",
		"How long a worker's claim on a run lasts without renewal.",
		"A run whose lease expired is returned to the queue.",
	&tuvl_lease_timeout, 30000, 1000, INT_MAX, PGC_SIGHUP, GUC_UNIT_MS, false},
	{"tuvl.heartbeat_interval",
		"How often workers renew the leases of the runs they hold.",
		"Keep it well below tuvl.lease_timeout.",
	&tuvl_heartbeat_interval, 5000, 100, INT_MAX, PGC_SIGHUP, GUC_UNIT_MS, false},
	{"tuvl.runs_per_worker",
		"Maximum number of runs one worker holds at once.",
		"Held runs waiting for HTTP effects count too: this bounds the transfers in flight per worker.",
	&tuvl_runs_per_worker, 512, 1, 100000, PGC_SIGHUP, 0, false},
	{"tuvl.launcher_naptime",
		"How often the launcher rescans databases without being woken.",
		NULL,
	&tuvl_launcher_naptime, 10000, 100, INT_MAX, PGC_SIGHUP, GUC_UNIT_MS, false},
	{"tuvl.sync_timeout",
		"Default time tuvl.run() executes a run before handing it to the workers.",
		"A workflow's trigger.sync_timeout and the sync_timeout argument override it.",
	&tuvl_sync_timeout, 30000, 0, INT_MAX, PGC_USERSET, GUC_UNIT_MS, false},
	{"tuvl.max_recoveries",
		"Times a run is taken up again after its worker died while holding it, before it fails.",
		"Counted since the run last got further (a result journaled, another step); the run then fails with _last_error_type recovery_limit, so that a response or a step that kills its worker is not sent or run again and again.",
	&tuvl_max_recoveries, 3, 0, 1000, PGC_SIGHUP, 0, false},
};

/* Timeouts and size limits, in the order they are defined. */
static const IntGuc limit_gucs[] = {
	{"tuvl.http_timeout",
		"Default timeout of one HTTP request.",
		"A step's own timeout overrides it.",
	&tuvl_http_timeout, 30000, 100, INT_MAX, PGC_USERSET, GUC_UNIT_MS, false},
	{"tuvl.agent_tool_timeout",
		"Wall-clock limit of one tool call of an autonomous agent.",
		"A tool that runs longer ends the agent on its error exit.",
	&tuvl_agent_tool_timeout, 300, 1, INT_MAX / 1000, PGC_SUSET, GUC_UNIT_S, false},
	{"tuvl.step_timeout",
		"Wall-clock limit of a step that sets no timeout of its own.",
		"SQL is cancelled at the deadline; the step takes its error route with _last_error_type timeout. Time spent paused or waiting for a person does not count. 0 means tuvl.max_step_timeout, and more is cut to it.",
	&tuvl_step_timeout, 10 * 60 * 1000, 0, INT_MAX, PGC_USERSET, GUC_UNIT_MS, false},
	{"tuvl.max_batch_time",
		"How long a worker's batch of transitions may run before it commits.",
		"A transition still running at the limit is cancelled and executed again on its own, so a slow step never holds up other runs' commits.",
	&tuvl_max_batch_time, 50, 1, 60000, PGC_SIGHUP, GUC_UNIT_MS, false},
	{"tuvl.max_input_size",
		"Largest run input tuvl.start_run() and tuvl.run() accept.",
		NULL,
	&tuvl_max_input_size, 8 * 1024 * 1024, 1024, MaxAllocSize, PGC_SUSET, GUC_UNIT_BYTE, false},
	{"tuvl.max_output_size",
		"Largest output a step may write to the run's context.",
		"A step whose output is larger fails with _last_error_type too_large.",
	&tuvl_max_output_size, 16 * 1024 * 1024, 1024, MaxAllocSize, PGC_SUSET, GUC_UNIT_BYTE, false},
	{"tuvl.max_source_size",
		"Largest YAML document register_workflow(), register_artifact() and register_llm() accept.",
		NULL,
	&tuvl_max_source_size, 1024 * 1024, 1024, MaxAllocSize, PGC_SUSET, GUC_UNIT_BYTE, false},
	{"tuvl.max_worker_memory",
		"Memory a worker may hold for its runs and the responses in flight.",
		"Past it the worker claims no runs and starts no requests until memory is freed, except one request at a time.",
	&tuvl_max_worker_memory, 256 * 1024, 1024, MAX_KILOBYTES, PGC_SIGHUP, GUC_UNIT_KB, false},
	{"tuvl.agent_pause_max",
		"How long an autonomous agent may stay paused.",
		"An agent paused longer is aborted: it takes its aborted exit.",
	&tuvl_agent_pause_max, 300, 1, INT_MAX / 1000, PGC_SIGHUP, GUC_UNIT_S, false},
	{"tuvl.http_max_response_size",
		"Largest HTTP response body accepted; larger ones fail the request.",
		NULL,
	&tuvl_http_max_response_size, 10 * 1024 * 1024, 1024, 1024 * 1024 * 1024, PGC_SUSET, GUC_UNIT_BYTE, false},
	{"tuvl.http_max_redirects",
		"Redirects an HTTP request follows at most (each target must be allowed).",
		NULL,
	&tuvl_http_max_redirects, 5, 0, 50, PGC_SUSET, 0, false},
};

/* Define the integer GUCs of a table, in its order. */
static void
define_int_gucs(const IntGuc *gucs, int n)
{
	for (int i = 0; i < n; i++)
	{
		const IntGuc *g = &gucs[i];

		/* a postmaster-level setting can only be defined while preloading */
		if (g->preload_only && !process_shared_preload_libraries_in_progress)
			continue;
		DefineCustomIntVariable(g->name, g->short_desc, g->long_desc,
								g->variable, g->boot, g->min, g->max,
								g->context, g->flags, NULL, NULL, NULL);
	}
}

/*
 * Bounds on what one role's runs may take from the others, in the order
 * they are defined: no step runs for ever, child runs nest and multiply
 * only so far, and metric series have a share per role.
 */
static const IntGuc bound_gucs[] = {
	{"tuvl.max_step_timeout",
		"Longest wall-clock limit of any step.",
		"A step's timeout and tuvl.step_timeout are cut to it, and timeout: 0 means it: no step occupies a worker longer.",
	&tuvl_max_step_timeout, 60 * 60 * 1000, 1000, INT_MAX, PGC_SUSET, GUC_UNIT_MS, false},
	{"tuvl.max_child_depth",
		"How many Workflow steps deep child runs may nest below a run.",
		"A Workflow step that would start a child deeper fails with _last_error_type child_limit.",
	&tuvl_max_child_depth, 8, 0, 1000, PGC_SUSET, 0, false},
	{"tuvl.max_run_tree",
		"How many child runs Workflow steps may start under one run, at every depth.",
		"A Workflow step that would start more fails with _last_error_type child_limit, before starting any.",
	&tuvl_max_run_tree, 10000, 1, 100000000, PGC_SUSET, 0, false},
	{"tuvl.metric_series_per_role",
		"How many metric series the runs of one role may create, of the 8,192 the server holds.",
		"Additions to a new series past it are dropped and counted in tuvl.metrics.dropped.",
	&tuvl_metric_series_per_role, 2048, 0, 8192, PGC_SIGHUP, 0, false},
};

/* tuvl.retention: empty, or an interval that is not negative. */
static bool
check_retention(char **newval, void **extra, GucSource source)
{
	Interval   *volatile iv = NULL;
	Interval	zero;
	MemoryContext cxt = CurrentMemoryContext;

	if (*newval == NULL || (*newval)[0] == '\0')
		return true;
	PG_TRY();
	{
		iv = DatumGetIntervalP(DirectFunctionCall3(interval_in, CStringGetDatum(*newval),
												   ObjectIdGetDatum(InvalidOid), Int32GetDatum(-1)));
	}
	PG_CATCH();
	{
		MemoryContextSwitchTo(cxt);
		FlushErrorState();
	}
	PG_END_TRY();
	if (iv == NULL)
	{
		GUC_check_errdetail("tuvl.retention must be an interval, such as 30 days.");
		return false;
	}
	memset(&zero, 0, sizeof(zero));
	if (DatumGetBool(DirectFunctionCall2(interval_lt, IntervalPGetDatum(iv), IntervalPGetDatum(&zero))))
	{
		GUC_check_errdetail("tuvl.retention must not be negative.");
		return false;
	}
	return true;
}

/* tuvl.http_ca_file: empty, or an absolute path (read when a request is made). */
static bool
check_ca_file(char **newval, void **extra, GucSource source)
{
	if (*newval == NULL || (*newval)[0] == '\0' || is_absolute_path(*newval))
		return true;
	GUC_check_errdetail("tuvl.http_ca_file must be an absolute path, such as /etc/tuvl/ca.pem.");
	return false;
}

/* tuvl.databases: a list of database names, as search_path is written. */
static bool
check_databases(char **newval, void **extra, GucSource source)
{
	char	   *raw;
	List	   *names;
	bool		ok;

	if (*newval == NULL)
		return true;
	raw = pstrdup(*newval);
	ok = SplitIdentifierString(raw, ',', &names);
	list_free(names);
	pfree(raw);
	if (!ok)
		GUC_check_errdetail("tuvl.databases must be a comma-separated list of database names.");
	return ok;
}

/*
 * tuvl.partition: run ids carry it, and tuvl_router routes by them, so a
 * session must not change it; it comes from the configuration file, ALTER
 * SYSTEM, or ALTER DATABASE ... SET (a partition may be a database).
 */
static bool
check_partition(int *newval, void **extra, GucSource source)
{
	if (source <= PGC_S_DATABASE || source == PGC_S_TEST)
		return true;
	GUC_check_errdetail("tuvl.partition is set per server or per database, not per role or session.");
	GUC_check_errhint("Use ALTER DATABASE ... SET tuvl.partition = N, or the server's configuration.");
	return false;
}

void
GucsDefine(void)
{
	define_int_gucs(worker_gucs, lengthof(worker_gucs));
	DefineCustomStringVariable("tuvl.http_allowed_hosts",
							   "Hosts that HTTP effects (APICall, MCP, LLM calls) may reach.",
							   "A comma-separated list of host, host:port, *.domain or host:* patterns; "
							   "empty (the default) allows none, * allows any.",
							   &tuvl_http_allowed_hosts, "",
							   PGC_SUSET, 0, NULL, NULL, NULL);
	define_int_gucs(limit_gucs, lengthof(limit_gucs));
	define_int_gucs(bound_gucs, lengthof(bound_gucs));
	DefineCustomBoolVariable("tuvl.http_verify_tls",
							 "Verify TLS certificates and host names of HTTPS requests.",
							 "Turn off only for testing.",
							 &tuvl_http_verify_tls, true,
							 PGC_SUSET, 0, NULL, NULL, NULL);
	DefineCustomStringVariable("tuvl.http_ca_file",
							   "A PEM file of certificate authorities HTTPS requests trust besides the system's.",
							   "An absolute path readable by the server, for a private CA; empty (the default): the system's only.",
							   &tuvl_http_ca_file, "",
							   PGC_SUSET, 0, check_ca_file, NULL, NULL);
	DefineCustomStringVariable("tuvl.oauth_redirect_uri",
							   "Where an OAuth authorization server sends a person back after tuvl.mcp_connect().",
							   "The redirect URI registered for tuvl's OAuth client, such as the console's /oauth/callback; the page there hands the URL it was opened with to tuvl.mcp_connect_finish().",
							   &tuvl_oauth_redirect_uri, "",
							   PGC_USERSET, 0, NULL, NULL, NULL);
	DefineCustomBoolVariable("tuvl.http2",
							 "Use HTTP/2 with multiplexing where an HTTPS server offers it.",
							 "Off: every request uses HTTP/1.1, one connection per request in flight.",
							 &tuvl_http2, true,
							 PGC_SUSET, 0, NULL, NULL, NULL);
	DefineCustomStringVariable("tuvl.databases",
							   "The databases tuvl workers run in.",
							   "A comma-separated list of database names (folded to lower case unless double-quoted); empty (the default): every database that has the extension.",
							   &tuvl_databases, "",
							   PGC_SIGHUP, GUC_LIST_INPUT, check_databases, NULL, NULL);
	DefineCustomStringVariable("tuvl.retention",
							   "How long tuvl.purge() keeps finished runs, by default.",
							   "An interval such as 30 days; empty (the default): tuvl.purge() needs its argument. Nothing is deleted unless tuvl.purge() is called (from pg_cron, say).",
							   &tuvl_retention, "",
							   PGC_SUSET, 0, check_retention, NULL, NULL);
	DefineCustomStringVariable("tuvl.otlp_endpoint",
							   "Where to export spans of runs, over OTLP/HTTP (JSON).",
							   "For example http://127.0.0.1:4318/v1/traces; empty: no traces. The host must be in tuvl.http_allowed_hosts.",
							   &tuvl_otlp_endpoint, "",
							   PGC_SIGHUP, 0, NULL, NULL, NULL);
	DefineCustomBoolVariable("tuvl.log_agent_events",
							 "Write a server log line for each agent turn, tool call and exit.",
							 "Each line is \"tuvl agent event\" and a JSON object with the event, run, step, iteration and trace id.",
							 &tuvl_log_agent_events, false,
							 PGC_SUSET, 0, NULL, NULL, NULL);
	DefineCustomIntVariable("tuvl.partition",
							"The number of this database's partition behind tuvl_router; -1: not partitioned.",
							"Run ids created here carry it: id = partition * 2^44 + n. Set it before the first run and never change it.",
							&tuvl_partition, -1, -1, 511,
							PGC_SUSET, 0, check_partition, NULL, NULL);
	MarkGUCPrefixReserved("tuvl");
}
