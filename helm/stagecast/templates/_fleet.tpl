{{/*
The fleet (fleet.enabled): names, the group's shape and the render-time checks of fleet-*.yaml.

  <fullname>-pipeline             LeaderWorkerSet; group g is pipeline "<fullname>-pipeline-<g>" (its leader pod's name)
  <fullname>-pipeline-gateways    headless Service of the leader pods: the door finds the gateways by its DNS
  <fullname>-door                 HAProxy Deployment + ConfigMap; the public "<fullname>-gateway" Service selects it
*/}}

{{- define "stagecast.fleet.lws" -}}{{ include "stagecast.fullname" . }}-pipeline{{- end -}}
{{- define "stagecast.fleet.gateways" -}}{{ include "stagecast.fullname" . }}-pipeline-gateways{{- end -}}
{{- define "stagecast.fleet.door" -}}{{ include "stagecast.fullname" . }}-door{{- end -}}

{{/* Stage ranks of one pipeline: stages.count x sp x cfgParallel. */}}
{{- define "stagecast.fleet.ranks" -}}
{{- $s := .Values.stages -}}
{{- mul ($s.count | int) ($s.sp | default 1 | int) ($s.cfgParallel | default 1 | int) -}}
{{- end -}}

{{/* Pods of one group: the leader and one worker per stage rank; a one-rank pipeline is the leader alone. */}}
{{- define "stagecast.fleet.size" -}}
{{- $ranks := include "stagecast.fleet.ranks" . | int -}}
{{- if eq $ranks 1 }}1{{ else }}{{ add1 $ranks }}{{ end -}}
{{- end -}}

{{/* The most pipelines there can be: the door's server-template slots. */}}
{{- define "stagecast.fleet.maxPipelines" -}}
{{- $f := .Values.fleet -}}
{{- if gt (int $f.door.maxPipelines) 0 -}}{{ int $f.door.maxPipelines }}
{{- else if $f.autoscaling.enabled -}}{{ int $f.autoscaling.maxPipelines }}
{{- else -}}{{ int $f.pipelines }}
{{- end -}}
{{- end -}}

{{/* A pod's own FQDN under the LeaderWorkerSet's headless Service (LWS names it after the set). */}}
{{- define "stagecast.fleet.podFQDN" -}}
{{- printf "$(POD_NAME).%s.%s.svc.%s" (include "stagecast.fleet.lws" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* The group's coordinator, as every pod of the group dials it ($(LWS_LEADER_ADDRESS): "<lws>-<g>.<lws>.<ns>"). */}}
{{- define "stagecast.fleet.coordinatorAddress" -}}
{{- printf "$(LWS_LEADER_ADDRESS).svc.%s:%d" .Values.clusterDomain (int .Values.coordinator.port) -}}
{{- end -}}

{{/* terminationGracePeriodSeconds of every pod of a group: the drain and its margin, at least the component's. */}}
{{- define "stagecast.fleet.grace" -}}
{{- $f := .ctx.Values.fleet -}}
{{- max (int .own) (add (int (ceil $f.drainSeconds)) (int $f.drainMarginSeconds)) -}}
{{- end -}}

{{/*
preStop of the coordinator and the stages: wait (at most the drain and its margin) while the group's gateway still
answers on its agent port, so that they serve the draining gateway's streams to their end. Kubernetes signals every
container of a deleted pod at once, and the gateway alone drains.
*/}}
{{- define "stagecast.fleet.waitForDrain" -}}
preStop:
  exec:
    command:
      - python
      - -c
      - |
        import os, socket, time
        host, end = os.environ.get("LWS_LEADER_ADDRESS", "127.0.0.1"), time.monotonic() + {{ include "stagecast.fleet.grace" (dict "ctx" .ctx "own" 0) }}
        while time.monotonic() < end:
            try:
                socket.create_connection((host, {{ int .ctx.Values.fleet.agentPort }}), timeout=2).close()
            except OSError:
                break
            time.sleep(1)
{{- end -}}

{{/* Render-time checks of the fleet values (included by every fleet template). */}}
{{- define "stagecast.fleet.validate" -}}
{{- $f := .Values.fleet -}}
{{- $a := $f.autoscaling -}}
{{- if lt (int $f.pipelines) 1 -}}
{{- fail (printf "stagecast: fleet.pipelines must be >= 1 (got %d)" (int $f.pipelines)) -}}
{{- end -}}
{{- if $a.enabled -}}
{{- if gt (int $a.minPipelines) (int $a.maxPipelines) -}}
{{- fail (printf "stagecast: fleet.autoscaling.minPipelines (%d) exceeds fleet.autoscaling.maxPipelines (%d)" (int $a.minPipelines) (int $a.maxPipelines)) -}}
{{- end -}}
{{- if or (lt (int $f.pipelines) (int $a.minPipelines)) (gt (int $f.pipelines) (int $a.maxPipelines)) -}}
{{- fail (printf "stagecast: fleet.pipelines (%d) must lie in fleet.autoscaling.minPipelines..maxPipelines (%d..%d): it is the count at install" (int $f.pipelines) (int $a.minPipelines) (int $a.maxPipelines)) -}}
{{- end -}}
{{- if not $a.prometheus.serverAddress -}}
{{- fail "stagecast: fleet.autoscaling.enabled needs fleet.autoscaling.prometheus.serverAddress: the Prometheus that scrapes the gateways' stagecast_gateway_slots gauges (e.g. http://prometheus-operated.monitoring.svc:9090)" -}}
{{- end -}}
{{- end -}}
{{- $max := include "stagecast.fleet.maxPipelines" . | int -}}
{{- if lt $max (int $f.pipelines) -}}
{{- fail (printf "stagecast: fleet.door.maxPipelines (%d) is below fleet.pipelines (%d): the door would not see every pipeline" $max (int $f.pipelines)) -}}
{{- end -}}
{{- if and $a.enabled (lt $max (int $a.maxPipelines)) -}}
{{- fail (printf "stagecast: fleet.door.maxPipelines (%d) is below fleet.autoscaling.maxPipelines (%d)" $max (int $a.maxPipelines)) -}}
{{- end -}}
{{- /* The leader StatefulSet's pods carry "<lws>-<g>-<hash>" (controller-revision-hash, <= 63), and the worker
StatefulSets are named "<lws>-<g>". */ -}}
{{- $longest := printf "%s-%d" (include "stagecast.fleet.lws" .) (sub $max 1) -}}
{{- if gt (len $longest) 52 -}}
{{- fail (printf "stagecast: with fleet.enabled the pipeline names (%s) must stay within 52 characters: shorten fullnameOverride or the release name" $longest) -}}
{{- end -}}
{{- $leader := $f.leader -}}
{{- $ports := list (int .Values.coordinator.port) (int .Values.coordinator.healthPort) (int $leader.coordinatorMetricsPort) (int .Values.gateway.port) (int .Values.gateway.healthPort) (int .Values.metrics.port) (int $f.agentPort) -}}
{{- if .Values.web.enabled }}{{ $ports = append $ports (int .Values.web.port) }}{{ end -}}
{{- if eq (include "stagecast.fleet.size" . | int) 1 -}}
{{- $ports = concat $ports (list (int .Values.stages.port) (int $leader.stageMetricsPort) (int $leader.stageHealthPort)) -}}
{{- end -}}
{{- if ne (len $ports) (len (uniq $ports)) -}}
{{- fail (printf "stagecast: with fleet.enabled the leader pod's containers share one network, and their ports collide: %v (coordinator port, healthPort, fleet.leader.coordinatorMetricsPort, gateway port, healthPort, metrics.port, fleet.agentPort, web.port; a one-stage pipeline adds stages.port, fleet.leader.stageMetricsPort and stageHealthPort)" $ports) -}}
{{- end -}}
{{- end -}}

{{/*
The door's haproxy.cfg: files/haproxy.cfg.tmpl (the fleet engineer's, shared with `stagecast up --pipelines`, whose
launcher/door.py fills it with Python's string.Template) with its three placeholders filled for the cluster:
  bind     every address of the door pod on gateway.port, with TLS the gateway's public certificate
  servers  a server-template over the pipelines' headless Service, one slot per pipeline there can be
  web      the same over the pages' port (web.enabled), or nothing
and the `resolvers` section those name appended.
*/}}
{{- define "stagecast.fleet.haproxyCfg" -}}
{{- $f := .Values.fleet -}}
{{- $max := include "stagecast.fleet.maxPipelines" . | int -}}
{{- $host := printf "%s.%s.svc.%s" (include "stagecast.fleet.gateways" .) .Release.Namespace .Values.clusterDomain -}}
{{- $bind := printf "*:%d" (int .Values.gateway.port) -}}
{{- if .Values.security.gatewayTLS.enabled -}}
{{- $bind = printf "%s ssl crt /etc/stagecast/door-tls/door.pem alpn h2,http/1.1" $bind -}}
{{- end -}}
{{- $servers := printf "    server-template pipeline 1-%d %s:%d agent-port %d resolvers kube init-addr none" $max $host (int .Values.gateway.port) (int $f.agentPort) -}}
{{- $web := "" -}}
{{- if .Values.web.enabled -}}
{{- $web = printf "    server-template page 1-%d %s:%d check resolvers kube init-addr none" $max $host (int .Values.web.port) -}}
{{- end -}}
{{- $tmpl := .Files.Get "files/haproxy.cfg.tmpl" -}}
{{- if not (contains "${servers}" $tmpl) -}}
{{- fail "stagecast: files/haproxy.cfg.tmpl is missing or has no ${servers} placeholder" -}}
{{- end -}}
{{- $tmpl | replace "${bind}" $bind | replace "${servers}" $servers | replace "${web}" $web | replace "$$" "$" | trimSuffix "\n" }}

# The pipelines by DNS: the headless Service's A records (its leader pods, ready or not: the agent says "down" while a
# pipeline loads). A record gone (a scaled-in pipeline) is held through its drain before its server slot is freed.
resolvers kube
    parse-resolv-conf
    accepted_payload_size 8192
    resolve_retries 3
    timeout resolve 1s
    timeout retry 1s
    hold valid 5s
    hold nx 5s
    hold obsolete {{ include "stagecast.fleet.grace" (dict "ctx" . "own" 0) }}s
{{- end -}}
