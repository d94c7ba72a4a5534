/* prefetch.ts: a run's page asks for its run and journal before the rest of the script has run (api.ts, take()). */
import { prefetch } from "./api";

const m = /^\/console\/runs\/([0-9]{1,18})\/?$/.exec(location.pathname);
if (m) {
    prefetch(`/api/console/runs/${m[1]}`);
    prefetch(`/api/console/runs/${m[1]}/journal`);
}
